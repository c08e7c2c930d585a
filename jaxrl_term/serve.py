"""The embedded JAX engine behind SGLang's HTTP contract.

``python -m jaxrl_term.serve --model-dir DIR [--port P]`` (SGLang's flag names are accepted too:
``--model-path``, ``--context-length``, ``--max-running-requests``; GPU-only ones are ignored), so the SGLang
client, the launcher and SGLang tooling work against it. Endpoints: ``/generate`` (single and batched),
``/update_weights_from_disk``, ``/model_info`` (``/get_model_info``), ``/health``, ``/health_generate``,
``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/get_server_info``. Responses have
SGLang 0.5's shapes. ``/v1/chat/completions`` (OpenAI style, through the chat template) lets it serve as a
local LLM judge.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxrl_term.rollout.engine import EngineError, SamplingParams

log = logging.getLogger("jaxrl_term.serve")


def sampling_from_request(sp: dict, default_stop_ids: tuple[int, ...]) -> SamplingParams:
    stop = sp.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_ids = tuple(int(x) for x in (sp.get("stop_token_ids") or ()))
    if not sp.get("ignore_eos", False):
        stop_ids = tuple(dict.fromkeys(stop_ids + default_stop_ids))
    seed = sp.get("sampling_seed", sp.get("seed"))
    return SamplingParams(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=int(sp.get("top_k", -1)),
        max_new_tokens=int(sp.get("max_new_tokens", 128)),  # SGLang's default
        stop_token_ids=stop_ids,
        stop=stop,
        seed=None if seed is None else int(seed),
    )


def finish_reason_json(gen) -> dict:
    if gen.finish_reason == "stop":
        return {"type": "stop", "matched": gen.matched_stop}
    if gen.finish_reason == "length":
        return {"type": "length", "length": len(gen.output_ids)}
    return {"type": "abort", "message": "aborted"}


def create_app(engine, tokenizer=None, model_path: str = "", tokenizer_path: str = "") -> Starlette:
    default_stop: tuple[int, ...] = ()
    if tokenizer is not None:
        ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        default_stop = tuple(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)
    state = {"model_path": model_path, "paused": False}

    def err(msg: str, code: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": msg}, "object": "error", "message": msg}, status_code=code)

    async def one(ids, text, sp: dict, rid: str, return_logprob: bool, skip_special: bool) -> dict:
        if ids is None:
            if tokenizer is None or text is None:
                raise EngineError("give input_ids (no tokenizer loaded for text)", retryable=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        t0 = time.monotonic()
        gen = await engine.generate(ids, sampling_from_request(sp, default_stop))
        out_text = tokenizer.decode(gen.output_ids, skip_special_tokens=skip_special) if tokenizer else None
        meta = {
            "id": rid,
            "finish_reason": finish_reason_json(gen),
            "prompt_tokens": len(ids),
            "completion_tokens": len(gen.output_ids),
            "cached_tokens": gen.cached_tokens or 0,
            "weight_version": str(gen.weight_version),
            "e2e_latency": time.monotonic() - t0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(gen.output_logprobs, gen.output_ids)]
            meta["input_token_logprobs"] = []
        return {"text": out_text, "output_ids": gen.output_ids, "meta_info": meta}

    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return err("request body is not JSON")
        if body.get("stream"):
            return err("streaming is not supported by jaxrl_term.serve")
        sp = body.get("sampling_params") or {}
        ids, text = body.get("input_ids"), body.get("text")
        rl, skip = bool(body.get("return_logprob", False)), bool(sp.get("skip_special_tokens", True))
        batched = (isinstance(ids, list) and ids and isinstance(ids[0], list)) or isinstance(text, list)
        try:
            if batched:
                items = ids if ids is not None else [None] * len(text)
                texts = text if isinstance(text, list) else [None] * len(items)
                rids = body.get("rid") or [uuid.uuid4().hex for _ in items]
                sps = sp if isinstance(sp, list) else [sp] * len(items)
                out = await asyncio.gather(*(one(i, t, s, r, rl, skip) for i, t, s, r in zip(items, texts, sps, rids)))
                return JSONResponse(list(out))
            return JSONResponse(await one(ids, text, sp, body.get("rid") or uuid.uuid4().hex, rl, skip))
        except (EngineError, ValueError, TypeError) as e:
            return err(str(e))

    async def chat_completions(request: Request):
        """OpenAI-style chat completions through the chat template (e.g. to serve a local LLM judge)."""
        if tokenizer is None:
            return err("chat completions need a tokenizer in the model dir (or --tokenizer-path)")
        body = await request.json()
        try:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            sp = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                  "max_new_tokens": body.get("max_tokens") or body.get("max_completion_tokens") or 512,
                  "stop": body.get("stop"), "seed": body.get("seed")}
            gen = await engine.generate(ids, sampling_from_request(sp, default_stop))
        except (KeyError, EngineError, ValueError, TypeError) as e:
            return err(str(e))
        out = gen.output_ids[:-1] if gen.finish_reason == "stop" and isinstance(gen.matched_stop, int) else gen.output_ids
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "jaxrl_term"),
            "choices": [{"index": 0, "finish_reason": "length" if gen.finish_reason == "length" else "stop",
                         "message": {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)}}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.output_ids),
                      "total_tokens": len(ids) + len(gen.output_ids)}})

    async def update_weights_from_disk(request: Request):
        body = await request.json()
        path = body.get("model_path")
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            engine.pause("abort")
        try:
            if not path or not Path(path).is_dir():
                raise EngineError(f"model_path {path!r} is not a directory", retryable=False)
            await engine.update_weights(path, version if version is not None else engine.weight_version)
        except EngineError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        finally:
            if body.get("abort_all_requests") and not state["paused"]:
                engine.resume()
        state["model_path"] = path
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    async def model_info(request: Request):
        return JSONResponse({"model_path": state["model_path"], "tokenizer_path": tokenizer_path,
                             "is_generation": True, "weight_version": str(engine.weight_version),
                             "preferred_sampling_params": None})

    async def health(request: Request):
        return JSONResponse({}) if await engine.health() else err("engine is not running", 503)

    async def health_generate(request: Request):
        if state["paused"]:
            return JSONResponse({})
        try:
            await asyncio.wait_for(engine.generate([default_stop[0] if default_stop else 0],
                                                   SamplingParams(max_new_tokens=1, temperature=0)), 60)
            return JSONResponse({})
        except Exception as e:  # noqa: BLE001 - any failure means "not ready"
            return err(f"generation failed: {e}", 503)

    async def pause(request: Request):
        body = await request.json() if await request.body() else {}
        engine.pause(body.get("mode", "abort"))
        state["paused"] = True
        return JSONResponse({"success": True})

    async def resume(request: Request):
        engine.resume()
        state["paused"] = False
        return JSONResponse({"success": True})

    async def flush_cache(request: Request):
        if any(engine.slots):
            return JSONResponse({"success": False, "message": "requests are running"}, status_code=400)
        engine.slot_cache = [[] for _ in engine.slot_cache]
        return JSONResponse({"success": True})

    async def server_info(request: Request):
        return JSONResponse({"version": "jaxrl_term", "engine": "jax", "max_batch": engine.cfg.max_batch,
                             "context_length": engine.cfg.max_seq_len, "stats": engine.stats})

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/pause_generation", pause, methods=["POST"]),
        Route("/continue_generation", resume, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.serve")
    ap.add_argument("--model-dir", "--model-path", dest="model_dir", required=True)
    ap.add_argument("--tokenizer-path", default=None, help="default: the model dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-batch", "--max-running-requests", dest="max_batch", type=int, default=16)
    ap.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=4096)
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument("--compute-dtype", default="float32")
    # accepted for command-line compatibility with sglang.launch_server; meaningless here
    for flag in ("--tp-size", "--dp-size", "--mem-fraction-static", "--admin-api-key"):
        ap.add_argument(flag, default=None)
    for flag in ("--skip-server-warmup", "--enable-memory-saver"):
        ap.add_argument(flag, action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    model = load_pretrained(args.model_dir, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype)
    tok_dir = args.tokenizer_path or args.model_dir
    tokenizer = None
    if (Path(tok_dir) / "tokenizer.json").is_file():
        from jaxrl_term.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tok_dir)
    engine = JaxEngine(model, tokenizer, JaxEngineConfig(max_batch=args.max_batch, max_seq_len=args.max_seq_len))
    app = create_app(engine, tokenizer, os.path.abspath(args.model_dir), os.path.abspath(tok_dir))
    log.info("serving %s on http://%s:%d", args.model_dir, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
