"""Shared fixtures: tiny random models of several architectures, built in code (no hub)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled CPU steps under inductor's Python wrapper: the C++ one (the engine's default on CPUs with
# AMX) builds each graph's host code with a C++ compiler, ~4x the compile time of test_cache.py; the
# tests that compile under it set DRAFTSMITH_COMPILE_WRAPPER=cpp themselves.
os.environ.setdefault("DRAFTSMITH_COMPILE_WRAPPER", "python")

VOCAB = 128


def _process_state() -> dict:
    return {"threads": torch.get_num_threads(), "default dtype": torch.get_default_dtype(),
            "grad enabled": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled()}


@pytest.fixture(autouse=True)
def _process_state_unchanged():
    """A test that leaves torch's process-wide settings changed alters every test after it in this
    process (a bench run with `--threads 1` once ran two thirds of the suite on one of the two cores):
    an error, the settings put back."""
    before = _process_state()
    yield
    after = _process_state()
    if after != before:
        torch.set_num_threads(before["threads"])
        torch.set_default_dtype(before["default dtype"])
        torch.set_grad_enabled(before["grad enabled"])
        pytest.fail(f"the test left torch's settings at {after}, it found {before}")


def _config(arch: str, vocab: int = VOCAB, layers: int = 2, hidden: int = 64, window: int = 8):
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                  tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if arch == "mistral":  # a small sliding window exercises rollback of windowed KV caches
        return MistralConfig(sliding_window=window, **common)
    if arch == "gemma3":  # alternating sliding/full layers
        return Gemma3TextConfig(head_dim=16, sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                                **{k: v for k, v in common.items() if k != "num_hidden_layers"}, num_hidden_layers=2)
    raise ValueError(arch)


@functools.lru_cache(maxsize=None)
def _cached_tiny(arch: str, seed: int, vocab: int, layers: int, scale: float) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, vocab, layers), dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked, tie-free logits, like a trained model.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale / p.shape[-1] ** 0.5)
    return model.eval()


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 2,
               scale: float = 2.0) -> torch.nn.Module:
    """A tiny random causal LM (cached per argument set; do not mutate it)."""
    return _cached_tiny(arch, seed, vocab, layers, scale)


def interrupted_on_call(fn, n: int = 2):
    """``fn`` that raises KeyboardInterrupt on its ``n``-th call (a Ctrl-C in the middle of a run)."""
    calls = []

    def wrapper(*args, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return fn(*args, **kw)

    return wrapper


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 123) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise on its weights: agrees with it partially."""
    import copy

    g = torch.Generator().manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return twin.eval()


def smollm2_tokenizer():
    """SmolLM2-135M's tokenizer alone, from the cached conversion (converting once if needed)."""
    from transformers import AutoTokenizer

    from draftsmith.models.verifier import resolve_spec

    return AutoTokenizer.from_pretrained(resolve_spec("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct verifier (float32, CPU)."""
    from draftsmith.models.verifier import load_verifier

    return load_verifier("smollm2-135m", dtype="float32", device="cpu")


def verifier_samples(verifier: torch.nn.Module, n: int, seed: int = 0, prompt_len: int = 8, gen_len: int = 40,
                     aux_layer_ids: tuple[int, ...] = (1, 2, 3)) -> list[dict]:
    """Captured-sample dicts (the format data.capture yields) from the verifier's own greedy outputs."""
    from draftsmith import generate

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(2, verifier.config.vocab_size, (prompt_len,), generator=g).tolist()
        gen = generate(verifier, prompt, max_new_tokens=gen_len, eos_token_id=[]).token_ids
        ids = torch.tensor(prompt + gen)
        seen = {}
        hook = verifier.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
        with torch.no_grad():
            o = verifier(ids[None], output_hidden_states=True)
        hook.remove()
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len:] = True
        out.append({"input_ids": ids, "loss_mask": mask,
                    "aux": torch.cat([o.hidden_states[i][0] for i in aux_layer_ids], -1),
                    "last": seen["x"][0]})
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # ids 0, 1, 2: conftest's bos 0, eos = pad = 1


def echo_model(vocab: int, layers: int = 12, hidden: int = 256, seed: int = 0,
               opener: tuple[int, int] | None = None) -> torch.nn.Module:
    """A Llama whose greedy output repeats its last input token: a verifier a draft can match.

    The layers' weights are small, so the residual stream stays close to the token's
    embedding, and the output head is the embedding matrix: the logits are the
    similarity of the current token to every token, highest for itself. ``opener``
    ``(a, b)``: after token a comes b (then b forever), e.g. a visible letter after the
    newline that opens an assistant turn. Deep enough
    (12 layers) that a verifier forward costs several times a one-layer draft step, so
    a draft that learns the echo is measurably faster (the gate's pass path in tests,
    on a measured speedup).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.05 / p.shape[-1] ** 0.5)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        if opener is not None:  # row b also points at a, more strongly than a's own row does
            a, b = opener
            model.lm_head.weight[b] += 1.5 * model.model.embed_tokens.weight[a]
    return model.eval()


def save_chat_tokenizer(path: Path, tokens: list[str]) -> None:
    """A byte-level tokenizer over ``tokens`` (id = position; no merges: one token per byte) with
    SPECIALS as special tokens and a ChatML template, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", chat_template=CHATML).save_pretrained(path)


def save_tiny_chat_verifier(path: Path, layers: int = 8, echo: bool = False) -> Path:
    """A byte-level tokenizer with a ChatML template and a random tiny Llama, saved as an HF directory.

    8 layers: the default aux layers [2, n//2, n-3] must be distinct. ``echo``: the
    verifier is :func:`echo_model` (predictable, and slow enough for a draft to pay): its
    replies are "aaaa...".
    """
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    save_chat_tokenizer(path, tokens)
    model = (echo_model(len(tokens), opener=(tokens.index("Ċ"), tokens.index("a"))) if echo
             else tiny_model("llama", vocab=len(tokens), layers=layers))
    model.save_pretrained(path)
    return path


def require_engine(find):
    """``find()`` (a serving engine's build or venv), or a clear failure naming its make target;
    a skip instead where ``DRAFTSMITH_ENGINES_OPTIONAL=1``."""
    from draftsmith.errors import DraftsmithError

    try:
        return find()
    except DraftsmithError as e:
        if os.environ.get("DRAFTSMITH_ENGINES_OPTIONAL") == "1":
            pytest.skip(f"{e}; skipped because DRAFTSMITH_ENGINES_OPTIONAL=1")
        pytest.fail(f"{e}; set DRAFTSMITH_ENGINES_OPTIONAL=1 to skip instead", pytrace=False)
