"""`generate`: a whole batch through any engine-shaped object (`LLMEngine`, `DataParallelEngine`)."""

from __future__ import annotations

from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams


def generate_batch(engine, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
    """`generate` over any engine-shaped object (`LLMEngine`, `DataParallelEngine`): validate the whole batch,
    queue it under fresh ids, step until every request finished, outputs in input order. An interrupted call
    aborts what it queued, so nothing keeps running behind the caller's back."""
    prompts = list(prompts)
    if isinstance(sampling_params, SamplingParams) or sampling_params is None:
        params = [sampling_params or SamplingParams()] * len(prompts)
    else:
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    ids = engine.fresh_request_ids("gen", len(prompts))
    prepared = [engine.make_request(rid, prompt, p) for rid, prompt, p in zip(ids, prompts, params, strict=True)]
    for p in prepared:
        engine.add_prepared_request(p)
    results: dict[str, RequestOutput] = {}
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="generate", unit="req")
    pending = set(ids)
    try:
        while pending:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)[:5]} vanished without finishing")
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
    except BaseException:
        for rid in pending:
            engine.abort(rid)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [results[i] for i in ids]
