"""Regenerated replies from an OpenAI-compatible server (vLLM, llama-server, SGLang).

At scale the verifier's replies are best written by a serving engine, which batches
continuously; the hidden states are still captured in process (the engine does not
export them), so the server must serve *the same verifier*. :func:`check_verifier`
makes sure of it before any reply is kept: the server answers two probe prompts
greedily and the in-process verifier scores its tokens teacher-forced; every token
must be the verifier's argmax or within ``tolerance`` logits of it (a numerical near-tie
between two engines or dtypes), else the endpoint is refused. A model with the same
tokenizer but other weights (another size, a different fine-tune) picks tokens the
verifier ranks well below its own within a few dozen tokens.

:func:`regenerate_via_endpoint` then runs :func:`draftsmith.data.regenerate.regenerate`
with the server as its :class:`~draftsmith.data.generation.ReplySource`: the same
records, order, resume and fingerprint handling as in process, plus
``meta.generation.engine = "endpoint"``. Up to ``batch_size`` requests are in flight
at once (the server batches them); records are written batch by batch in the
in-process order, so a resumed run writes the same file.

Requests are ``/v1/completions`` with the prompt as token ids (the verifier's chat
template applied here, as in process), every sampling setting stated (a server's
model defaults, e.g. vLLM's generation-config penalties, must not apply) and
``return_token_ids`` (vLLM). A server that answers text only (llama-server, most
others) has its reply re-tokenized with the verifier's tokenizer.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from draftsmith.data.generation import Reply
from draftsmith.data.regenerate import regenerate
from draftsmith.data.chat import encode_chat
from draftsmith.data.conversation import Conversation
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

# A non-streamed completion sends nothing until it is done, queueing on the server included.
REQUEST_TIMEOUT = 3600.0
PROBE_PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
                 "Explain step by step how to make a cup of tea.")
PROBE_TOKENS = 32
PROBE_TOLERANCE = 1.0  # logits: the served token's probability is at least e^-1 of the argmax's


@dataclass
class Completion:
    """One answer of the server.

    Attributes:
        token_ids: the generated ids as the server returned them (stop token included), or the
            text re-tokenized when the server returns text only.
        finish_reason: ``stop`` or ``length``.
        exact_ids: whether ``token_ids`` came from the server (not re-tokenized).
    """

    token_ids: list[int]
    finish_reason: str
    exact_ids: bool


class Endpoint:
    """An OpenAI-compatible completions server, used with token-id prompts.

    Args:
        url: ``http://HOST:PORT`` (a trailing ``/v1`` is accepted).
        tokenizer: the verifier's tokenizer (re-tokenizes text-only answers).
        model: the served model name; None: the only one ``/v1/models`` lists.

    Raises:
        DraftsmithError: the server cannot be reached, lists no model, or several and none was named.
    """

    def __init__(self, url: str, tokenizer: Any, model: str | None = None) -> None:
        base = url.strip().rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.tokenizer = tokenizer
        if model is None:
            listed = [str(m.get("id")) for m in self._call("GET", "/v1/models", None, timeout=30).get("data", [])]
            if len(listed) != 1:
                raise DraftsmithError(f"endpoint {self.base} serves {len(listed)} models ({', '.join(listed)}); "
                                      "it must serve exactly one, the verifier")
            model = listed[0]
        self.model = model

    def _call(self, method: str, path: str, payload: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:500]
            raise DraftsmithError(f"endpoint {self.base}{path} answered HTTP {e.code}: {body}") from e
        except (urllib.error.URLError, OSError) as e:
            raise DraftsmithError(f"endpoint {self.base}{path}: {getattr(e, 'reason', e)} (is the server "
                                  "running, and is this its http://HOST:PORT?)") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DraftsmithError(f"endpoint {self.base}{path} did not answer JSON: not an OpenAI-compatible "
                                  "server") from e

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                 stop_ids: Sequence[int], seed: int | None = None) -> Completion:
        """One completion of ``prompt_ids`` (token ids), stopping at ``stop_ids`` or ``max_tokens``."""
        payload: dict[str, Any] = {
            "model": self.model, "prompt": [int(t) for t in prompt_ids], "max_tokens": max_tokens,
            "temperature": float(params.temperature), "top_p": 1.0 if params.top_p is None else params.top_p,
            # Stated so that no server default (a model's generation config, llama-server's
            # top-k 40 / min-p 0.05) changes the distribution: what in process samples from.
            "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "stop_token_ids": [int(t) for t in stop_ids], "ignore_eos": False,
            "return_token_ids": True}
        if seed is not None and not params.greedy:
            payload["seed"] = seed
        answer = self._call("POST", "/v1/completions", payload, timeout=REQUEST_TIMEOUT)
        try:
            choice = answer["choices"][0]
            reason = str(choice.get("finish_reason"))
            ids = choice.get("token_ids")
            text = choice.get("text", "")
        except (KeyError, IndexError, TypeError) as e:
            raise DraftsmithError(f"endpoint {self.base} answered a completion without choices: "
                                  f"{json.dumps(answer)[:300]}") from e
        if reason not in ("stop", "length"):
            raise DraftsmithError(f"endpoint {self.base} ended a completion with finish_reason {reason!r}: "
                                  f"{json.dumps(answer)[:300]}")
        if ids is not None:
            return Completion([int(t) for t in ids], reason, True)
        return Completion(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), reason, False)

    def reply(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams, eos: Sequence[int],
              seed: int | None = None) -> Reply:
        """``(ids before the first end-of-sequence token, stop | length)``, as in-process regeneration."""
        c = self.complete(prompt_ids, max_tokens, params, eos, seed)
        stop = set(eos)
        end = next((i for i, t in enumerate(c.token_ids) if t in stop), None)
        if end is not None:
            return c.token_ids[:end], "stop"
        # A text-only server drops the stop token from its text: its finish_reason says why it ended.
        return c.token_ids, c.finish_reason


def check_verifier(endpoint: Endpoint, model: torch.nn.Module, tokenizer: Any,
                   tolerance: float = PROBE_TOLERANCE) -> dict[str, Any]:
    """Refuse an endpoint that does not serve ``model``: greedy probes scored teacher-forced.

    Returns:
        ``{"tokens", "argmax", "max_margin"}``: probe tokens scored, how many were the
        in-process argmax, and the largest logit gap to it.

    Raises:
        DraftsmithError: a probe token is outside the verifier's vocabulary or more than
            ``tolerance`` logits below the verifier's argmax (names the prompt, position and tokens).
    """
    from draftsmith.data.generation import eos_ids

    eos = eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    greedy = SamplingParams()
    tokens = argmax = 0
    worst = 0.0
    for text in PROBE_PROMPTS:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": text}])
        reply = endpoint.complete(prompt, PROBE_TOKENS, greedy, eos).token_ids
        if not reply:
            continue
        if max(reply) >= vocab or min(reply) < 0:
            raise DraftsmithError(f"endpoint {endpoint.base} answered token id {max(reply)} but the verifier's "
                                  f"vocabulary has {vocab}: it serves another model ({endpoint.model})")
        ids = torch.tensor([prompt + reply], device=device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()  # [R, V] predicts reply
        chosen = logits.gather(1, torch.tensor(reply, device=device)[:, None])[:, 0]
        margin = (logits.max(-1).values - chosen).cpu()
        tokens += len(reply)
        argmax += int((margin == 0).sum())
        worst = max(worst, float(margin.max()))
        bad = int(margin.argmax())
        if margin[bad] > tolerance:
            mine = int(logits[bad].argmax())
            raise DraftsmithError(
                f"endpoint {endpoint.base} does not serve this verifier: on probe {text!r} its greedy token "
                f"{bad} is {reply[bad]} ({tokenizer.decode([reply[bad]])!r}), {float(margin[bad]):.2f} logits below "
                f"the verifier's {mine} ({tokenizer.decode([mine])!r}); the tolerance for numerical near-ties is "
                f"{tolerance}. Serve the verifier itself ({endpoint.model} is served), or drop --endpoint")
    if not tokens:
        raise DraftsmithError(f"endpoint {endpoint.base} answered the probes with no tokens; cannot check that it "
                              "serves the verifier")
    return {"tokens": tokens, "argmax": argmax, "max_margin": round(worst, 4)}


class EndpointSource:
    """Replies from an :class:`Endpoint`, ``concurrency`` requests in flight, yielded batch by batch in order.

    Worker threads take requests in input order and are daemons: an interrupted run
    (error, Ctrl-C) stops taking new ones and does not wait for those in flight.
    """

    engine = "endpoint"

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        if concurrency < 1:
            raise DraftsmithError(f"--batch-size (requests in flight) must be >= 1, got {concurrency}")
        self.endpoint, self.concurrency = endpoint, concurrency

    def replies(self, batches: list[tuple[list[list[int]], list[int]]], params: SamplingParams,
                max_new_tokens: int, eos: list[int]) -> Iterator[list[Reply]]:
        tasks = [(b, i, p, s) for b, (prompts, seeds) in enumerate(batches) for i, (p, s) in enumerate(zip(prompts,
                                                                                                            seeds))]
        results: list[list[Any]] = [[None] * len(prompts) for prompts, _ in batches]
        remaining = [len(prompts) for prompts, _ in batches]
        todo: queue.Queue = queue.Queue()
        for t in tasks:
            todo.put(t)
        cond = threading.Condition()
        stop = threading.Event()
        failed: dict[int, Exception] = {}  # batch -> the first error of a request in it

        def work() -> None:
            while not stop.is_set():
                try:
                    b, i, prompt, seed = todo.get_nowait()
                except queue.Empty:
                    return
                with cond:
                    if failed and b >= min(failed):  # it could not be written anyway
                        return
                try:
                    r: Any = self.endpoint.reply(prompt, max_new_tokens, params, eos, seed)
                except Exception as e:  # handed to the consumer, which raises it
                    with cond:
                        failed.setdefault(b, e)
                        cond.notify_all()
                    return
                with cond:
                    results[b][i] = r
                    remaining[b] -= 1
                    cond.notify_all()

        threads = [threading.Thread(target=work, daemon=True, name=f"endpoint-{n}")
                   for n in range(min(self.concurrency, len(tasks)))]
        for t in threads:
            t.start()
        try:
            for b in range(len(batches)):
                # Batches before a failed one still complete and are written; the failed one raises.
                with cond:
                    while remaining[b] and not (failed and min(failed) <= b):
                        cond.wait(timeout=1.0)
                if remaining[b]:
                    e = failed[min(failed)]
                    if isinstance(e, DraftsmithError):
                        raise DraftsmithError(f"{e}; the replies finished before it are kept, re-run the same "
                                              "command to continue") from e
                    raise e
                yield results[b]
        finally:
            stop.set()


def regenerate_via_endpoint(url: str, model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation],
                            out_path: Path, *, max_new_tokens: int = 256, temperature: float = 0.0,
                            top_p: float | None = None, batch_size: int = 8, max_prompt_tokens: int | None = None,
                            seed: int = 0, progress: bool = True, fingerprint: str | None = None,
                            say: Callable[[str], None] = log.info, deadline: float | None = None,
                            on_stop: Callable[[int, int], None] | None = None) -> Path:
    """:func:`~draftsmith.data.regenerate.regenerate` with the replies written by the server at ``url``.

    Args:
        url: the OpenAI-compatible server, ``http://HOST:PORT``; it must serve the verifier.
        model: the in-process verifier (its probes check the server; its context limits prompts).
        batch_size: requests in flight (and records per written batch).
        say: where the verifier check's result is told.
        others: as :func:`~draftsmith.data.regenerate.regenerate`.

    Raises:
        DraftsmithError: the server is unreachable, serves another model, or fails a request
            (finished replies stay in the file; re-run to continue), and as ``regenerate``.
    """
    endpoint = Endpoint(url, tokenizer)
    probe = check_verifier(endpoint, model, tokenizer)
    say(f"endpoint {endpoint.base} serves the verifier ({endpoint.model}): {probe['argmax']} of {probe['tokens']} "
        f"probe tokens are the in-process argmax, the largest gap {probe['max_margin']:.3f} logits")
    return regenerate(model, tokenizer, conversations, out_path, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_p=top_p, batch_size=batch_size,
                      max_prompt_tokens=max_prompt_tokens, seed=seed, progress=progress, fingerprint=fingerprint,
                      source=EndpointSource(endpoint, batch_size), deadline=deadline, on_stop=on_stop)
