"""POST /generate of the SGLang double: GenerateReqInput parsed and checked as SGLang does, the injected faults, and
the answer computed under SGLang's finish rules (by the embedded model, or made up with --no-compute).

Asked for log-probabilities (``return_logprob``), an answer's meta_info has ``output_token_logprobs``: ``[logprob,
token_id, text or null]`` for every completion id (a matched stop id included, also where ``exclude_stop`` leaves it
out of output_ids), ``output_top_logprobs`` (such triples, ``top_logprobs_num`` per id) when asked, and
``input_token_logprobs: []`` (the double computes none for the prompt). The figures come from one float32 forward of
the model over the prompt and the whole completion (less the ids it has no embedding for, whose figures are null), so
they are the model's for the ids served, think blocks of --reasoning included: raw (log-softmax of the logits) when
the request is greedy (temperature 0 or top_k 1) or SGLANG_RETURN_ORIGINAL_LOGPROB is true in the double's
environment, otherwise after temperature (log-softmax of logits / temperature), as SGLang's sampler gives them; plus
the knob ``logprob_offset`` (an engine that computes another model). --no-compute answers null figures."""

import asyncio
import logging
import time
import zlib

import torch
from aiohttp import web

from sglang_double.protocol import (
    PRE_FAULTS,
    SAMPLING_KEYS,
    TAIL,
    RequestError,
    dumps,
    loads,
    logprob_fields,
    request_ids,
    sglang_error,
)

log = logging.getLogger("sglang_server")


class GenerateEndpoint:
    """The /generate half of FakeSGLang (server.py), which holds the state these methods read: knobs, tokenizer,
    engine, stats, in-flight and aborted rids."""

    def pick_fault(self) -> str | None:
        k = self.knobs
        n = self.requests
        self.requests += 1
        if (
            not k["fault_rate"]
            or not k["faults"]
            or (k["fault_budget"] is not None and self.injected >= k["fault_budget"])
        ):
            return None
        if k["fault_mode"] == "cycle":
            if int((n + 1) * k["fault_rate"]) <= int(n * k["fault_rate"]):
                return None
            kind = k["faults"][self.injected % len(k["faults"])]
        elif self.rng.random() >= k["fault_rate"]:
            return None
        else:
            kind = self.rng.choice(k["faults"])
        self.injected += 1
        return kind

    def parse_items(self, body) -> tuple[bool, list[dict]]:
        """GenerateReqInput, normalised as SGLang does: (is_single, [{input_ids, sampling_params, rid, and the
        protocol's LOGPROB_FIELDS}])."""
        single, inputs = self.parse_inputs(body)
        n = len(inputs)
        rids = request_ids(body.get("rid"), single, n)
        sps = body.get("sampling_params") or {}
        sps = [sps] * n if isinstance(sps, dict) else sps
        if not isinstance(sps, list) or len(sps) != n:
            raise RequestError("sampling_params should be a dict or one dict per request")
        figures = logprob_fields(body, single, inputs)
        return single, [
            {"input_ids": list(i), "sampling_params": self.sampling(sp), "rid": r, **f}
            for i, sp, r, f in zip(inputs, sps, rids, figures)
        ]

    def parse_inputs(self, body) -> tuple[bool, list[list[int]]]:
        """(is_single, the prompts' token ids) of a GenerateReqInput: its text tokenized, or its input_ids checked."""
        if not isinstance(body, dict):
            raise RequestError("the request body should be a JSON object")
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if given[0] == "input_embeds":
            raise RequestError("input_embeds are not supported by the test server")
        if body.get("stream"):
            raise RequestError("stream is not supported by the test server")
        if given[0] == "text":
            texts = body["text"]
            single = isinstance(texts, str)
            inputs = [self.tokenizer.encode(t) for t in ([texts] if single else texts)]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_ids should be a non-empty list")
            single = not isinstance(ids[0], list)
            inputs = [ids] if single else ids
        for ids in inputs:
            if not ids or not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise RequestError("input_ids should hold valid token ids (and not be empty)")
        return single, inputs

    def sampling(self, sp: dict) -> dict:
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise RequestError(f"unknown sampling params {sorted(unknown)}")
        sp = {k: v for k, v in sp.items() if v is not None}
        p = {
            **self.defaults,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "no_stop_trim": False,
            "spaces_between_special_tokens": True,
            **sp,
        }
        if not p["temperature"] >= 0.0:
            raise RequestError(f"temperature must be non-negative, got {p['temperature']}.")
        if not 0.0 < p["top_p"] <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {p['top_p']}.")
        if not 0.0 <= p["min_p"] <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {p['min_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        if p["max_new_tokens"] < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        for k in ("repetition_penalty",):
            if p.get(k, 1.0) != 1.0:
                raise RequestError(f"{k} != 1 is not supported by the test server")
        for k in ("frequency_penalty", "presence_penalty", "min_new_tokens"):
            if p.get(k, 0) != 0:
                raise RequestError(f"{k} != 0 is not supported by the test server")
        if p.get("stop") or p.get("stop_regex") or p.get("regex") or p.get("json_schema") or p.get("ebnf"):
            raise RequestError("stop strings and grammars are not supported by the test server")
        return p

    def compute(self, item: dict) -> dict:
        """One request, as SGLang would answer it (runs in the single compute thread)."""
        ids, sp, rid = item["input_ids"], item["sampling_params"], item["rid"]
        start = time.perf_counter()
        stops = set() if sp["ignore_eos"] else set(sp["stop_token_ids"]) | self.eos
        limit = sp["max_new_tokens"]
        block, model_ids = self.reasoning_parts(ids) if self.knobs["reasoning"] else ([], ids)
        budget = max(limit - len(block), 0)  # a think block counts against max_new_tokens
        gen = block + self.generated(model_ids, sp, stops, budget, rid)
        # SGLang's Req.check_finished: the length limit first, then the stop ids; the matched id stays in output_ids.
        if len(gen) >= limit:
            gen, finish = gen[:limit], {"type": "length", "length": limit}
        elif gen and gen[-1] in stops:
            finish = {"type": "stop", "matched": gen[-1]}
        else:
            finish = {"type": "length", "length": limit}
        text_ids = gen[:-1] if finish["type"] == "stop" and not sp["no_stop_trim"] else gen
        text = self.tokenizer.decode(text_ids, skip_special_tokens=sp["skip_special_tokens"]) if self.engine else ""
        out_ids = gen[:-1] if finish["type"] == "stop" and self.knobs["exclude_stop"] else gen
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.args.weight_version,
            "completion_tokens": len(gen),
            "cached_tokens": 0,
        }
        if item["return_logprob"]:
            meta.update(self.logprob_info(item, gen))
        meta["e2e_latency"] = round(time.perf_counter() - start, 6)
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    def logprob_info(self, item: dict, gen: list) -> dict:
        """What meta_info holds of the completion ``gen``'s log-probabilities (the module docstring); None for an id
        the model has no embedding for (a marker the test tokenizer adds)."""
        text = item["return_text_in_logprobs"]
        info = {"input_token_logprobs": []}
        readable = [k for k, t in enumerate(gen) if t < self.embeddings] if self.engine is not None else []
        if not readable:
            info["output_token_logprobs"] = [self.logprob_entry(None, t, text) for t in gen]
            return info
        figures = self.completion_logprobs(item, [gen[k] for k in readable]) + self.knobs["logprob_offset"]
        chosen = figures.gather(-1, torch.tensor([gen[k] for k in readable])[:, None])[:, 0].tolist()
        by_position = dict(zip(readable, chosen))
        info["output_token_logprobs"] = [self.logprob_entry(by_position.get(k), t, text) for k, t in enumerate(gen)]
        if item["top_logprobs_num"] > 0:
            top = figures.topk(item["top_logprobs_num"], -1)
            rows = zip(top.values.tolist(), top.indices.tolist())
            tops = {k: [self.logprob_entry(f, t, text) for f, t in zip(*row)] for k, row in zip(readable, rows)}
            info["output_top_logprobs"] = [tops.get(k, []) for k in range(len(gen))]
        return info

    def logprob_entry(self, figure: float | None, token: int, text: bool) -> list:
        """[logprob, token id, its text (only when ``text``)], as SGLang's detokenize_logprob_tokens gives it."""
        return [figure, token, self.tokenizer.decode([token]) if text else None]

    @torch.inference_mode()
    def completion_logprobs(self, item: dict, gen: list) -> torch.Tensor:
        """[len(gen), vocabulary] log-probabilities of each position of the readable completion ``gen``, from one
        float32 forward over the readable prompt and ``gen``: raw when greedy or original_logprob, else after
        temperature."""
        context = [t for t in item["input_ids"] if t < self.embeddings]
        logits = self.engine.model(torch.tensor([context + gen])).logits[0, len(context) - 1 : -1].float()
        sp = item["sampling_params"]
        if not (sp["temperature"] == 0 or sp["top_k"] == 1 or self.original_logprob):
            logits = logits / sp["temperature"]
        return torch.log_softmax(logits, -1)

    def generated(self, model_ids: list, sp: dict, stops: set, budget: int, rid: str) -> list:
        """At most ``budget`` ids the model answers ``model_ids`` with under sampling params ``sp``."""
        from eaglepipe.engines import Sampling

        if budget == 0:
            return []
        if self.engine is None:  # --no-compute: ids made up from the prompt, never a stop id unless asked
            h = zlib.crc32(repr(model_ids).encode())
            gen = [1000 + (h + 7919 * k) % 20000 for k in range(budget)]
            after = self.knobs["fake_stop_after"]
            if after and sp["stop_token_ids"] and after <= budget:
                gen = gen[: after - 1] + [min(sp["stop_token_ids"])]
            return gen
        top_k = sp["top_k"] if sp["top_k"] > 0 else -1
        sampling = Sampling(
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=top_k,
            min_p=sp["min_p"],
            max_new_tokens=budget,
            seed=int(sp.get("sampling_seed") or 0),
            stop_token_ids=tuple(sorted(stops)),
        )
        return next(self.engine.stream([model_ids], sampling, [rid]))[1].output_ids

    def corrupt(self, kind: str, answer: dict, prompt: list) -> dict:
        ids, meta = answer["output_ids"], answer["meta_info"]
        if kind == "prefix":
            answer["output_ids"] = prompt[-TAIL:] + ids
        elif kind == "count":
            meta["completion_tokens"] += 1
        elif kind == "abort":
            answer["output_ids"] = ids[: len(ids) // 2]
            meta["finish_reason"] = {"type": "abort", "message": "Abort in fault injection.", "status_code": 500}
        elif kind == "finish":
            meta["finish_reason"] = {"type": "weird"}
        return answer

    async def generate(self, request: web.Request):
        self.stats["generate_requests"] += 1
        port = request.transport.get_extra_info("peername")[1]  # the client's end of the connection
        if port not in self.stats["connections"]:
            self.stats["connections"].append(port)
        self.handling += 1
        self.stats["max_inflight"] = max(self.stats["max_inflight"], self.handling)
        try:
            return await self.generate_one(request)
        finally:
            self.handling -= 1

    async def generate_one(self, request: web.Request):
        raw = await request.read()
        try:
            body = loads(raw)
        except ValueError as e:
            return sglang_error(400, f"malformed JSON: {e}")
        if not self.ready():
            return sglang_error(503, "The server is starting.")
        try:
            single, items = self.parse_items(body)
        except RequestError as e:
            return sglang_error(400, str(e))
        dup = [it["rid"] for it in items if it["rid"] in self.inflight]
        if dup:
            return sglang_error(400, f"Duplicate request ID(s) still in flight: {dup}")
        fault = self.pick_fault()
        if any(it["rid"].split("#")[0] in self.knobs["fail_rids"] for it in items):
            fault = "http500"  # these records always fail (a permanent fault)
        if fault:
            self.stats["faults"][fault] = self.stats["faults"].get(fault, 0) + 1
            log.info("fault %s for %s", fault, [it["rid"] for it in items])
        rids = [it["rid"] for it in items]
        self.stats["rids"].extend(rids)
        self.inflight.update(rids)
        try:
            if fault in PRE_FAULTS:
                return await self.pre_fault(fault, request)
            if self.knobs["latency"]:
                await asyncio.sleep(self.knobs["latency"])
            loop = asyncio.get_running_loop()
            answers = []
            for it in items:
                if self.engine is None:
                    answers.append(self.compute(it))
                else:
                    answers.append(await loop.run_in_executor(self.compute_pool, self.compute, it))
            for it, a in zip(items, answers):
                if it["rid"] in self.aborted:
                    self.aborted.discard(it["rid"])
                    a["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort request.", "status_code": 400}
            if fault:
                answers[0] = self.corrupt(fault, answers[0], items[0]["input_ids"])
            self.stats["answers"] += len(answers)
            out = answers[0] if single and not self.knobs["batch_arrays"] else answers
            return web.Response(body=dumps(out), content_type="application/json")
        finally:
            self.inflight.difference_update(rids)
            self.aborted.difference_update(rids)

    async def pre_fault(self, fault: str, request: web.Request):
        if fault.startswith("http"):
            status = int(fault[4:])
            return sglang_error(
                status,
                {
                    429: "Too many requests.",
                    500: "Internal server error (injected).",
                    503: "Service unavailable (injected).",
                    400: "Invalid request (injected).",
                }[status],
            )
        if fault == "reset":
            request.transport.abort()
            raise asyncio.CancelledError  # nothing more to send on this connection
        if fault == "hang":
            await asyncio.sleep(self.knobs["hang_s"])
            return sglang_error(500, "hung (injected)")
        if fault == "malformed":
            return web.Response(body=b'{"text": "oops", "output_ids": [1, 2,', content_type="application/json")
        if fault == "truncated":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = 4096
            await resp.prepare(request)
            await resp.write(b'{"text": "partial", "output_ids": [1, 2, 3')
            request.transport.close()
            raise asyncio.CancelledError
        raise AssertionError(fault)
