"""The generation loop: prompts into the engine, steps until every completion is done, completions printed
(streamed for a single prompt) as they come."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from pagedjax.cli.args import PROG
from pagedjax.cli.ctrl_c import CtrlC, Interrupted
from pagedjax.cli.errors import CLIError
from pagedjax.cli.prompts import Prompts


@dataclass
class Peak:
    """The fullest moment of the KV pool during the run (stats at the end show an idle pool)."""

    blocks_used: int = 0
    kv_waste_pct: float = 0.0
    running: int = 0

    def observe(self, stats) -> None:
        memory = stats.scheduler.memory
        self.running = max(self.running, stats.scheduler.num_running)
        if memory.num_used_blocks >= self.blocks_used:
            self.blocks_used = memory.num_used_blocks
            self.kv_waste_pct = 100.0 * memory.waste_fraction


@dataclass
class Completion:
    index: int
    prompt: str
    text: str = ""
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    samples: list = field(default_factory=list)  # CompletionOutput (or beams) at the end, when there are several


class Generation:
    """Feeds prompts to the engine and steps it, printing completions as they come (streaming one prompt).

    While it runs, Ctrl-C only sets `ctrl_c.requested`; it is checked between engine steps (raising
    Interrupted), so a step is never cut off half-way.

    `on_compile` (the engine's `compile_notices` listener) says on `err` which program the run waits for, from its
    start to its end: a line ("pagedjax-generate: compiling step program 1 (first run; cached afterwards): step of
    16 tokens, 1 x 2 table ... compiled in 1.52 s"), or, while a streamed completion's line is open on a terminal,
    a note after its text that is erased when the program is ready (a line there would break the text)."""

    def __init__(self, engine, tokenizer, prompts: Prompts, args: argparse.Namespace, out: TextIO,
                 ctrl_c: CtrlC | None = None, err: TextIO | None = None):
        from pagedjax.sampling_params import SamplingParams

        self.engine, self.tokenizer, self.prompts, self.args, self.out = engine, tokenizer, prompts, args, out
        self.err = sys.stderr if err is None else err
        self._line = None  # the streamed completion's open line (its text since the last newline), once echoed
        self._note = 0  # characters of the note drawn after it (0: none)
        self._compiles = 0
        self.ctrl_c = ctrl_c if ctrl_c is not None else CtrlC(exit_process=False)
        self.completions = [Completion(i, p) for i, p in enumerate(prompts.texts)]
        self.by_id: dict[str, Completion] = {}
        self.peak = Peak()
        self.stream = (len(prompts.texts) == 1 and not args.no_stream and not args.json and args.n == 1
                       and args.beam_width is None)
        self._start = time.perf_counter()
        self._later: list[int] = []  # the demo's prompts queued once the first is done
        # --max-tokens, else the built-in prompts' own length, else None: until it stops or the context is full
        self.max_tokens = args.max_tokens if args.max_tokens is not None else prompts.max_tokens
        self._sampling = lambda i: SamplingParams(
            max_tokens=self.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed + i * args.n, ignore_eos=args.ignore_eos, n=args.n, logprobs=args.logprobs)

    def start(self) -> None:
        """Queue the prompts that go first, before anything is printed: a prompt the engine refuses (too
        long, bigger than the pool) is a CLIError. The demo queues its first prompt alone: it computes (and
        caches) the shared prefix, and the others, queued once it is done, find it in the cache."""
        if self.args.beam_width is not None:  # beam search validates its prompts itself, and runs alone
            return
        everything = list(range(len(self.completions)))
        first = everything[:1] if self.args.demo and self.args.enable_prefix_caching else everything
        self._later = everything[len(first):]
        self.submit(first)

    def run(self) -> float:
        """Generate every completion (after `start`); returns its wall time in seconds."""
        self._start = time.perf_counter()
        if self.args.beam_width is not None:
            return self._run_beam_search()
        with self.ctrl_c.stopping_between_steps():
            if self._later and not self.args.json:
                prefix = self.prompts.shared_prefix
                print(f"demo: the first prompt fills the prefix cache, the other {len(self._later)} share its "
                      f"{len(self.tokenizer.encode(prefix))}-token prefix\n", file=self.out)
                print("shared prefix:\n" + prefix, file=self.out)
            if self.stream:
                self._write(self.completions[0].prompt)
            self.drain()
            if self._later:
                self.submit(self._later)
                self.drain()
        self.engine.save_kv_tiers()  # the next run on the same --kv-disk-dir finds these prompts' prefixes
        return time.perf_counter() - self._start

    def _run_beam_search(self) -> float:
        from pagedjax.sampling_params import BeamSearchParams

        max_tokens = self.max_tokens
        if max_tokens is None:  # the rest of the context; beam search takes one bound: the longest prompt's room
            longest = max(len(self.tokenizer.encode(c.prompt)) for c in self.completions)
            max_tokens = max(self.engine.max_request_tokens - longest, 1)
        params = BeamSearchParams(beam_width=self.args.beam_width, max_tokens=max_tokens,
                                  ignore_eos=self.args.ignore_eos)
        for i, c in enumerate(self.completions):
            self._check_context(i, len(self.tokenizer.encode(c.prompt)))
        with self.ctrl_c.stopping_between_steps():
            try:
                results = self.engine.beam_search([c.prompt for c in self.completions], params)
            except (TypeError, ValueError) as e:
                raise CLIError(f"beam search: {e}") from None
        for c, result in zip(self.completions, results, strict=True):
            best = result.sequences[0]
            c.num_prompt_tokens = len(result.prompt_token_ids)
            c.text, c.num_tokens, c.finish_reason, c.samples = best.text, len(best.token_ids), "beam", result.sequences
            self._show_finished(c)
        return time.perf_counter() - self._start

    def submit(self, indices: list[int]) -> None:
        images = self.prompts.images
        for i, rid in zip(indices, self.engine.fresh_request_ids("prompt", len(indices)), strict=True):
            c = self.completions[i]
            if images:  # the engine expands the prompt's image placeholders, and checks the context after that
                prompt = {"prompt": c.prompt, "multi_modal_data": {"image": images}}
            else:
                prompt = self.tokenizer.encode(c.prompt)
                self._check_context(i, len(prompt))
            try:
                prepared = self.engine.make_request(rid, prompt, self._sampling(i))
                self.engine.add_prepared_request(prepared)
            except (TypeError, ValueError) as e:
                raise CLIError(f"prompt {i + 1}: {e}") from None
            c.num_prompt_tokens = prepared.request.num_prompt_tokens
            self.by_id[rid] = c

    def _check_context(self, i: int, num_prompt: int) -> None:
        """CLIError for a prompt whose --max-tokens go past the context (max_model_len), as the server and the
        engine refuse one (the engine's error names the Python field; this one the flag). A prompt longer than the
        context itself is the engine's error (`add_request`), and so is one the KV pool cannot hold."""
        limit, asked = self.engine.scheduler_config.max_model_len, self.max_tokens
        if asked is not None and num_prompt <= limit < num_prompt + asked:
            raise CLIError(f"prompt {i + 1}: this model's maximum context length is {limit} tokens, but "
                           f"{num_prompt + asked} were asked for ({num_prompt} in the prompt, --max-tokens {asked}); "
                           f"lower --max-tokens to {limit - num_prompt} or less, or raise --max-model-len")

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            if self.ctrl_c.requested:
                raise Interrupted
            for o in self.engine.step():
                self._take(o)
            self.peak.observe(self.engine.stats())
        if self.ctrl_c.requested:
            raise Interrupted

    def _take(self, o) -> None:
        c = self.by_id[o.request_id]
        # The engine decodes incrementally and never takes text back: what is new is what it added.
        piece = o.text[len(c.text):]
        c.text = o.text
        c.num_tokens = len(o.output_token_ids)
        c.num_cached_tokens = o.num_cached_tokens
        if self.stream and piece:
            self._write(piece)
        if o.finished:
            c.finish_reason, c.error = o.finish_reason, o.error
            if len(o.outputs) > 1 or self.args.logprobs is not None:
                c.samples = o.outputs
            self._show_finished(c)

    def _write(self, text: str) -> None:
        """Stream `text` on the completion's line (which stays open until it is finished)."""
        self.out.write(text)
        self.out.flush()
        self._line = (self._line or "") + text
        self._line = self._line.rsplit("\n", 1)[-1]

    def on_compile(self, event) -> None:
        """`engine.compile_notices`' listener (see the class docstring)."""
        from pagedjax.compile_cache import cache_note

        starting = event.seconds is None
        if self._line is not None and self.err.isatty():  # a note after the streamed text, erased when done
            if starting:
                note = f" [compiling ({cache_note()})...]"
                room = shutil.get_terminal_size().columns - len(self._line) - 1
                note = note if len(note) <= room else " [compiling...]" if room >= 15 else ""
                self.err.write(note)
                self._note = len(note)
            else:
                self.err.write("\b" * self._note + " " * self._note + "\b" * self._note)
                self._note = 0
        elif starting:
            self._compiles += 1
            what = event.note or f"step program {self._compiles}"
            # On a line of its own where both streams share one (a streamed line is open: `2>&1`, a log).
            self.err.write(f"{'' if not self._line else chr(10)}{PROG}: compiling {what} ({cache_note()}): "
                           f"{event.shape} ...")
        else:
            self.err.write(f" {'loaded from the compile cache' if event.loaded else 'compiled'} in "
                           f"{event.seconds:.2f} s\n")
        self.err.flush()

    def _show_finished(self, c: Completion) -> None:
        if self.args.json:
            return
        out, prefix = self.out, self.prompts.shared_prefix
        if self.stream:
            self._line = None
            print(file=out)
        else:
            label = f"[{c.index + 1}] " + ("(shared prefix) + " if prefix else "")
            print(f"{label}{c.prompt[len(prefix):]}{c.text}", file=out)
        for s in c.samples if len(c.samples) > 1 else ():
            which = f"beam {c.samples.index(s) + 1}, score {s.score:.3f}" if hasattr(s, "score") else \
                f"sample {s.index}"
            logprob = "" if s.cumulative_logprob is None else f", cumulative logprob {s.cumulative_logprob:.3f}"
            print(f"  [{c.index + 1}.{which}{logprob}] {s.text!r}", file=out)
        for s in c.samples:
            if getattr(s, "logprobs", None):
                decode = self.tokenizer.decode
                shown = " ".join(f"{decode([t.token_id])!r}:{t.logprob:.2f}" for t in s.logprobs)
                print(f"  logprobs [{c.index + 1}.{s.index}]: {shown}", file=out)
        finish = c.finish_reason + (f" ({c.error})" if c.error else "")
        cached = f", {c.num_cached_tokens} of {c.num_prompt_tokens} prompt tokens from the prefix cache"
        print(f"--- [{c.index + 1}] {c.num_tokens} tokens, finish: {finish}{cached}", file=out)
        print(file=out)
        out.flush()
