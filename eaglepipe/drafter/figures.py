"""train's report: the run's figures (metrics/train.json) and its history's last epoch."""

from __future__ import annotations

from eaglepipe.core import runtime


def last_epoch(history: list[dict], split: str) -> dict:
    """{loss_k, acc_k, and acc_se_k where measured} of ``split``'s rows in ``history``'s last epoch ({} for none)."""
    last = history[-1]["epoch"]
    return {
        f"{m}_{r['step']}": r[m]
        for r in history
        if r["epoch"] == last and r["split"] == split
        for m in ("loss", "acc", "acc_se")
        if m in r
    }


def report(t, seconds: float, rt: runtime.Runtime) -> dict:
    """The figures of ``t`` (train.Training): data, vocabulary coverage, the last epoch's train and valid rows, and
    its speed; where the states were computed (online, streamed), the agreement of the states' model with the
    answers' engine over the sequences this run computed (hidden/agreement.py; under ``run``: a resumed run computes
    fewer), and streamed, the spool's figures (drafter/spool.py)."""
    in_vocab = sum(c for tok, c in t.counts.items() if t.model.t2d[tok])
    checked = {"agreement": t.feats.agreement(rt)} if t.feats.kind != "offline" else {}
    streamed = {"spool": t.feats.report()} if t.feats.kind == "streamed" else {}
    return {
        "features": t.feats.kind,
        "epochs": len(t.plans),
        "steps": sum(len(b) for b in t.plans),
        "train_samples": len(t.train_set),
        "train_tokens": sum(s.ids.shape[0] for s in t.train_set),
        "valid_samples": len(t.valid_set),
        "draft_vocab_size": t.model.cfg.draft_vocab_size,
        "draft_vocab_coverage": round(in_vocab / max(1, sum(t.counts.values())), 5),
        "run": {
            "seconds": round(seconds, 1),
            "processes": rt.world,
            "device": str(rt.device),
            "autocast": t.p.autocast,
            "tokens_per_s": round(t.trained_tokens / seconds, 1) if t.trained_tokens else None,
            **checked,
            **streamed,
        },
        "train": last_epoch(t.progress.history, "train"),
        "valid": last_epoch(t.progress.history, "valid"),
    }
