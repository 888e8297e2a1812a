"""The SGLang client (eaglepipe/engines/sglang.py): its answer checks, and its retries, failover and limits against
tests/sglang_server.py in --no-compute mode (real protocol, made-up ids, no model) over loopback."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest
from sglang_server import CLEAN, VERSION, configure, distribution, free_port, start_server, stats, stop_server

from eaglepipe.core import config
from eaglepipe.engines import Failure, Output, Sampling, pool
from eaglepipe.engines.pool import ServerError, tokenizer_probes
from eaglepipe.engines.server import BadAnswer
from eaglepipe.engines.sglang import SGLangEngine, check_answer, sampling_params
from eaglepipe.target import chat
from eaglepipe.target import model as target

STOP = 2  # the embedded model's <|im_end|>
SAMPLING = Sampling(max_new_tokens=8, stop_token_ids=(STOP,))
PROMPT = [1, 9690, 198, 2683, 314, 216, 34, 30, 216, 34, 47, 2, 198, 1, 520, 9531, 198]
PROMPT_TOKENS = len(PROMPT)


# ---- answer checks (no server) ------------------------------------------------------------------------------------
def answer(ids, finish, count=None, rid="r", prompt_tokens=PROMPT_TOKENS):
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids) if count is None else count,
            "cached_tokens": 0,
        },
    }


def test_a_stop_answer_keeps_its_stop_id():
    ids, reason, _ = check_answer(answer([5, 6, STOP], {"type": "stop", "matched": STOP}), PROMPT, SAMPLING, "r")
    assert (ids, reason) == ([5, 6, STOP], "stop")


def test_a_server_that_leaves_the_stop_id_out_gets_it_back():
    ids, reason, _ = check_answer(answer([5, 6], {"type": "stop", "matched": STOP}, count=3), PROMPT, SAMPLING)
    assert (ids, reason) == ([5, 6, STOP], "stop")


def test_length_on_a_stop_id_is_a_stop_like_the_embedded_engine():
    ids = [5] * 7 + [STOP]
    assert check_answer(answer(ids, {"type": "length", "length": 8}), PROMPT, SAMPLING)[:2] == (ids, "stop")
    ids = [5] * 8
    assert check_answer(answer(ids, {"type": "length", "length": 8}), PROMPT, SAMPLING)[:2] == (ids, "length")


def test_a_batch_shaped_answer_of_one_is_accepted():
    assert check_answer([answer([5, STOP], {"type": "stop", "matched": STOP})], PROMPT, SAMPLING)[1] == "stop"


@pytest.mark.parametrize(
    "body, problem",
    [
        (answer(PROMPT[-5:] + [5, STOP], {"type": "stop", "matched": STOP}, count=2), "#10896"),
        (answer(PROMPT[-5:] + [5, STOP], {"type": "stop", "matched": STOP}), "#10896"),
        (answer([5, 6, STOP], {"type": "stop", "matched": STOP}, count=4), "completion_tokens"),
        (answer([5, 6], {"type": "abort", "message": "out of memory"}), "aborted"),
        (answer([5, 6], {"type": "weird"}), "unknown finish_reason"),
        (answer([5, 6], None), "unknown finish_reason"),
        (answer([5, 7], {"type": "stop", "matched": 7}), "not one of infer's stop ids"),
        (answer([5, 6], {"type": "stop", "matched": "</s>"}), "no stop strings"),
        (answer([5, STOP, 6], {"type": "length", "length": 3}), "after 3 of 8"),
        (answer([5, STOP, 6, 7, 8, 9, 10, 11], {"type": "length", "length": 8}), "before the end"),
        (answer([5] * 9, {"type": "length", "length": 9}), "max_new_tokens"),
        (answer([5, STOP], {"type": "stop", "matched": STOP}, rid="other"), "not 'r'"),
        (answer([5, STOP], {"type": "stop", "matched": STOP}, prompt_tokens=3), "prompt_tokens=3"),
        ([answer([5], {"type": "length"}), answer([6], {"type": "length"})], "2 answers"),
        ({"error": {"message": "boom"}}, "boom"),
        ("oops", "not an object"),
        ({"output_ids": [1, -2], "meta_info": {}}, "output_ids"),
    ],
)
def test_bad_answers_are_refused_with_the_reason(body, problem):
    with pytest.raises(BadAnswer, match=None) as e:
        check_answer(body, PROMPT, SAMPLING, "r")
    assert problem in str(e.value)


def test_every_sampling_param_is_explicit():
    sp = sampling_params(Sampling(max_new_tokens=9, top_k=-1, stop_token_ids=(2, 7)), "id1")
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids"):
        assert key in sp
    assert sp["skip_special_tokens"] is False and sp["stop_token_ids"] == [2, 7] and "sampling_seed" not in sp
    hot = sampling_params(Sampling(temperature=0.7, seed=3), "id1")
    assert hot["sampling_seed"] == sampling_params(Sampling(temperature=0.7, seed=3), "id1")["sampling_seed"]
    assert hot["sampling_seed"] != sampling_params(Sampling(temperature=0.7, seed=3), "id2")["sampling_seed"]


def test_tokenizer_probes_include_the_chat_templates_special_tokens(tokenizer):
    probes = tokenizer_probes(tokenizer)
    assert "<|im_start|>" in probes and "<|im_end|>" in probes
    assert any(p.startswith("<|im_start|>system") for p in probes)  # the rendered template


# ---- against the test server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = start_server(port, log, "--no-compute")
    url = f"http://127.0.0.1:{port}"
    yield url
    stop_server(proc)


@pytest.fixture
def fresh(server):
    deadline = time.monotonic() + 30  # let requests a test gave up on (a hang) finish first
    while stats(server)["inflight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    configure(server, **CLEAN)
    return server


def engine(url, tokenizer, **over):
    cfg = {
        "urls": [url],
        "concurrency": 4,
        "timeout_s": 5,
        "health_timeout_s": 10,
        "retries": 3,
        "backoff_s": 0.01,
        "backoff_max_s": 0.05,
        **over,
    }
    return SGLangEngine(config.Servers(**cfg), tokenizer)


def prompts(tokenizer, n):
    return [chat.prompt_ids(tokenizer, [{"role": "user", "content": f"question {i}"}]) for i in range(n)]


def run(eng, ps, sampling=SAMPLING):
    return dict(eng.stream(ps, sampling, [f"p{i}" for i in range(len(ps))]))


@pytest.mark.engine
def test_a_clean_run_streams_every_answer_within_the_concurrency(fresh, tokenizer):
    configure(fresh, latency=0.1)
    ps = prompts(tokenizer, 12)
    with engine(fresh, tokenizer, concurrency=3) as eng:
        # the embedded target is converted under the cache folder, whose path differs between clones: written <cache>
        assert eng.identity()["model_path"] == str(target.resolve("embedded")).replace(str(config.CACHE), "<cache>")
        described = eng.describe()
        assert str(config.CACHE) not in json.dumps(described)
        out = run(eng, ps)
    assert sorted(out) == list(range(12)) and all(isinstance(o, Output) for o in out.values())
    assert all(len(o.output_ids) == 8 and o.finish_reason == "length" and o.meta["attempts"] == 1 for o in out.values())
    assert [o.meta["rid"] for _, o in sorted(out.items())] == [f"p{i}" for i in range(12)]
    assert stats(fresh)["max_inflight"] == 3
    info = described["servers"][0]
    assert info["model_info"]["is_generation"] and "internal_states" not in info["server_info"]
    assert info["server_info"]["version"]


@pytest.mark.engine
def test_a_connection_idle_for_seconds_is_not_reused(fresh, tokenizer):
    """The server closes a connection idle for 5 s, as SGLang's and vLLM's do; the client lets one go after
    ``pool.IDLE_S``, so it never sends a request as the server closes the connection (that request was lost to a
    reset and sent again: ``attempts`` 2 in the records)."""
    with engine(fresh, tokenizer, concurrency=1) as eng:
        run(eng, prompts(tokenizer, 1))
        time.sleep(pool.IDLE_S + 1.0)  # idle past the client's limit, within the server's
        out = run(eng, prompts(tokenizer, 1))
    assert out[0].meta["attempts"] == 1 and len(stats(fresh)["connections"]) == 2


@pytest.mark.engine
def test_answers_arrive_in_completion_order_not_prompt_order(fresh, tokenizer):
    """A slow first answer does not hold the others back: the driver gets each as soon as it is there."""
    configure(fresh, latency=0.3, fault_rate=1.0, faults="http500", fault_mode="cycle", fault_budget=1)
    with engine(fresh, tokenizer, concurrency=4, backoff_s=0.5, backoff_max_s=0.5) as eng:
        got = list(eng.stream(prompts(tokenizer, 4), SAMPLING, ["a", "b", "c", "d"]))
    assert sorted(i for i, _ in got) == [0, 1, 2, 3]
    assert [o.meta["attempts"] for _, o in got] == [1, 1, 1, 2]  # the retried one came last, the others first


@pytest.mark.engine
@pytest.mark.parametrize(
    "fault",
    [
        "http429",
        "http500",
        "http503",
        "http400",
        "reset",
        "hang",
        "malformed",
        "truncated",
        "prefix",
        "count",
        "abort",
        "finish",
    ],
)
def test_each_fault_is_retried_and_the_answer_kept(fresh, tokenizer, fault):
    configure(fresh, fault_rate=1.0, faults=fault, fault_mode="cycle", fault_budget=1, hang_s=2)
    ps = prompts(tokenizer, 3)
    with engine(fresh, tokenizer, concurrency=1, timeout_s=1.5) as eng:
        out = run(eng, ps)
        client = dict(eng.stats)
    assert all(isinstance(o, Output) and len(o.output_ids) == 8 for o in out.values()), out
    assert sorted(o.meta["attempts"] for o in out.values()) == [1, 1, 2]
    assert stats(fresh)["faults"] == {fault: 1}
    kind = {
        "reset": "connection",
        "truncated": "connection",
        "hang": "timeout",
        "malformed": "malformed",
        "prefix": "check",
        "count": "check",
        "abort": "check",
        "finish": "check",
        "http400": "http4xx",
    }
    assert client.get(kind.get(fault, fault)) == 1, client


@pytest.mark.engine
def test_a_retry_gets_a_fresh_rid(fresh, tokenizer):
    configure(fresh, fault_rate=1.0, faults="http500", fault_mode="cycle", fault_budget=2)
    with engine(fresh, tokenizer, concurrency=1) as eng:
        out = run(eng, prompts(tokenizer, 1))
    assert out[0].meta["rid"] == "p0#3" and stats(fresh)["rids"][-3:] == ["p0", "p0#2", "p0#3"]


@pytest.mark.engine
def test_a_prompt_that_keeps_failing_becomes_a_failure_with_every_reason(fresh, tokenizer):
    configure(fresh, fail_rids=["p1"])
    with engine(fresh, tokenizer, retries=2) as eng:
        out = run(eng, prompts(tokenizer, 3))
    assert isinstance(out[1], Failure) and isinstance(out[0], Output) and isinstance(out[2], Output)
    assert out[1].reason.startswith("3 attempt(s)") and out[1].reason.count("http500") == 3


@pytest.mark.engine
def test_a_client_error_is_tried_once_more_then_given_up(fresh, tokenizer):
    configure(fresh, fault_rate=1.0, faults="http400", fault_mode="cycle")
    with engine(fresh, tokenizer, retries=5, concurrency=1) as eng:
        out = run(eng, prompts(tokenizer, 1))
    assert isinstance(out[0], Failure) and out[0].reason.startswith("2 attempt(s)")


@pytest.mark.engine
def test_the_stop_id_is_kept_whether_or_not_the_server_sends_it(fresh, tokenizer):
    ps = prompts(tokenizer, 2)
    got = []
    for exclude in (False, True):
        configure(fresh, fake_stop_after=5, exclude_stop=exclude)
        with engine(fresh, tokenizer) as eng:
            got.append(run(eng, ps))
    for with_stop, without in zip(got[0].values(), got[1].values()):
        assert with_stop.output_ids == without.output_ids and with_stop.output_ids[-1] == STOP
        assert len(with_stop.output_ids) == 5 and with_stop.finish_reason == without.finish_reason == "stop"


@pytest.mark.engine
def test_batch_shaped_answers_and_the_old_info_endpoints(fresh, tokenizer):
    configure(fresh, batch_arrays=True, old_api=True)
    with engine(fresh, tokenizer) as eng:
        out = run(eng, prompts(tokenizer, 2))
        assert eng.describe()["servers"][0]["model_info"]["model_path"]
    assert all(isinstance(o, Output) for o in out.values())


@pytest.mark.engine
def test_a_tokenizer_that_disagrees_stops_before_any_request(fresh, tokenizer):
    configure(fresh, tokenize_skew=True)
    before = stats(fresh)["generate_requests"]
    with pytest.raises(ServerError, match="tokenizer disagrees") as e:
        engine(fresh, tokenizer).start()
    assert "<|im_start|>" in str(e.value) and "server [" in str(e.value) and "local [" in str(e.value)
    assert stats(fresh)["generate_requests"] == before


def test_no_server_at_all_is_an_error_after_the_health_timeout(tokenizer):
    eng = engine(f"http://127.0.0.1:{free_port()}", tokenizer, health_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(ServerError, match="not healthy within"):
        eng.start()
    assert time.monotonic() - start < 10


@pytest.mark.engine
def test_a_server_that_goes_away_and_comes_back_gets_the_rest(fresh, tokenizer):
    configure(fresh, latency=0.05)
    ps = prompts(tokenizer, 24)
    seen = []
    with engine(fresh, tokenizer, concurrency=2, retries=2, health_timeout_s=20) as eng:
        for _, o in eng.stream(ps, SAMPLING, [f"p{i}" for i in range(len(ps))]):
            seen.append(o)
            if len(seen) == 4:  # SGLang answers 503 on /health and /generate while it restarts
                configure(fresh, unhealthy=True)
                threading.Timer(1.0, configure, (fresh,), {"unhealthy": False}).start()
        client = dict(eng.stats)
    assert len(seen) == 24 and all(isinstance(o, Output) for o in seen)
    assert client["server_down"] == client["server_back"] == 1


@pytest.mark.engine
def test_when_no_server_is_left_the_stream_raises(fresh, tokenizer):
    configure(fresh, latency=0.05)
    ps = prompts(tokenizer, 12)
    got = []
    with (
        engine(fresh, tokenizer, concurrency=2, health_timeout_s=1) as eng,
        pytest.raises(ServerError, match="no SGLang server left"),
    ):
        for i, _ in eng.stream(ps, SAMPLING, [f"p{i}" for i in range(len(ps))]):
            got.append(i)
            if len(got) == 3:
                configure(fresh, unhealthy=True)
    assert 3 <= len(got) < 12


@pytest.mark.engine
def test_load_spreads_over_several_servers(fresh, tokenizer):
    port = fresh.rsplit(":", 1)[1]
    urls = [fresh, f"http://localhost:{port}"]  # the same server under two names: two entries in rotation
    configure(fresh, latency=0.05)
    with engine(fresh, tokenizer, urls=urls, concurrency=4) as eng:
        out = run(eng, prompts(tokenizer, 16))
        assert len(eng.describe()["servers"]) == 2
    used = {o.meta["server"] for o in out.values()}
    assert used == set(urls)


@pytest.mark.engine
def test_stopping_early_cancels_what_is_in_flight_and_aborts_it_on_the_server(fresh, tokenizer):
    configure(fresh, latency=1.0)
    with engine(fresh, tokenizer, concurrency=4) as eng:
        stream = eng.stream(prompts(tokenizer, 40), SAMPLING, [f"p{i}" for i in range(40)])
        next(stream)
        time.sleep(0.2)  # the next requests are on their way
        start = time.monotonic()
        stream.close()
        assert time.monotonic() - start < 5
    s = stats(fresh)  # the server still works on what was in flight (it does not notice the disconnect)
    assert s["generate_requests"] < 40
    assert s["inflight"] and set(s["inflight"]) <= set(s["aborted_rids"])  # and was told to stop each one


@pytest.mark.engine
def test_stream_names_each_answer_by_its_prompt_index(fresh, tokenizer):
    ps = prompts(tokenizer, 3)
    with engine(fresh, tokenizer) as eng:
        outs = dict(eng.stream(ps, SAMPLING, ["x", "y", "z"]))
    assert {i: o.meta["rid"] for i, o in outs.items()} == {0: "x", 1: "y", 2: "z"}


def test_a_launched_server_that_dies_is_reported_with_its_log(tokenizer, tmp_path):
    launch = {
        "model_path": "embedded",
        "port": free_port(),
        "log": str(tmp_path / "server.log"),
        "command": [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"],
    }
    with pytest.raises(ServerError, match="exited with code 3") as e:
        SGLangEngine(config.Servers(launch=config.Launch(**launch), health_timeout_s=30), tokenizer).start()
    assert "no GPU here" in str(e.value)


@pytest.mark.engine
@pytest.mark.parametrize("installed", [VERSION, "9.9.9"])
def test_a_launched_server_must_report_the_identity_its_launch_predicts(tokenizer, tmp_path, monkeypatch, installed):
    """The identity (the cache key) of a launched server is known before it starts; once it runs, what it reports is
    checked against it: here the version the launcher's Python says is installed."""
    monkeypatch.setenv("PYTHONPATH", str(distribution(tmp_path / "site", "sglang", installed)))
    double = [sys.executable, str(Path(__file__).parent.parent / "sglang_server.py"), "--no-compute"]
    launch = config.Launch(model_path="embedded", port=free_port(), log=str(tmp_path / "log"), command=double)
    engine = SGLangEngine(config.Servers(launch=launch, health_timeout_s=60), tokenizer)
    predicted = engine.identity()
    assert predicted["sglang_version"] == installed and engine.launched.proc is None
    if installed == VERSION:
        with engine:
            assert engine.identity() == predicted and engine.describe()["servers"]
        return
    with pytest.raises(ServerError, match="reports .* but its launch arguments and the installed sglang say") as e:
        engine.start()
    assert f"'sglang_version': '{VERSION}'" in str(e.value) and "'sglang_version': '9.9.9'" in str(e.value)
    assert engine.launched.returncode() is not None  # stopped
