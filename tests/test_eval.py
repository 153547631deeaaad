"""`draftsmith eval`: teacher-forced acceptance, counted by hand on a verifier whose reply is known.

The verifier's final norm is zero, so every logit is 0 and its greedy reply is token 0 at
every step; token 0 is the byte "a". Each reply is therefore N "a"s, and the chat template
closes it with <|im_end|>: the reply tokens (the loss mask) are N "a"s and <|im_end|>. A draft
whose final norm is zero likewise proposes its vocabulary's first token at every step.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import SPECIALS, save_chat_tokenizer, tiny_model
from draftsmith.cli import EXIT_ERROR, main
from draftsmith.evaluate import teacher_forced_acceptance
from draftsmith.export import save_draft
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft

N, K = 13, 3  # reply length, draft length: 1 + 3 rounds of k + 1 tokens fill N in the engine
PROMPTS = ["Why is the sky blue?", "Name a prime.", "Say hi."]
# Chains of K targets inside the N + 1 reply tokens start at reply index s = 0 .. N + 1 - K; step j
# is accepted by an always-"a" draft while s + j < N (index N is <|im_end|>).
CHAINS = N + 1 - K + 1
AT_LAST_STEP = N - (K - 1)  # chains whose last target is still an "a"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenizers import pre_tokenizers

    root = tmp_path_factory.mktemp("eval")
    vdir = root / "verifier"
    # "a" first (token 0, the zero-logit argmax); <|im_end|> keeps id 1, the tiny config's eos.
    tokens = ["a", "<|im_end|>"] + [t for t in SPECIALS if t != "<|im_end|>"]
    tokens += [c for c in sorted(pre_tokenizers.ByteLevel.alphabet()) if c != "a"]
    save_chat_tokenizer(vdir, tokens)
    verifier = copy.deepcopy(tiny_model("llama", vocab=len(tokens), layers=8))
    with torch.no_grad():
        verifier.model.norm.weight.zero_()
    verifier.save_pretrained(vdir)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    right = save_draft(constant_draft(verifier, first=0), root / "right", verifier_name=str(vdir), verifier=verifier)
    wrong = save_draft(constant_draft(verifier, first=5), root / "wrong", verifier_name=str(vdir), verifier=verifier)
    return root, vdir, data, right, wrong


def constant_draft(verifier: torch.nn.Module, first: int) -> Eagle3Draft:
    """A draft over the tokens ``first..V-1`` that proposes token ``first`` at every step."""
    V = verifier.config.vocab_size
    d = Eagle3Draft(Eagle3Config.from_verifier(verifier.config, draft_vocab_size=V - first, num_draft_tokens=K))
    d.set_vocab(torch.arange(first, V))
    with torch.no_grad():
        d.norm.weight.zero_()  # all draft logits 0: argmax is draft id 0, i.e. token `first`
    return d.eval()


def run_eval(setup, *drafts: Path, **flags) -> tuple[int, dict]:
    root, vdir, data, _, _ = setup
    out = root / "eval.json"
    argv = ["eval", "--verifier", str(vdir), "--draft", *map(str, drafts), "--dataset", str(data),
            "--cache", str(root / "cache"), "--num-draft-tokens", str(K), "--max-new-tokens", str(N),
            "--device", "cpu", "--out", str(out)]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    rc = main(argv)
    return rc, json.loads(out.read_text()) if rc == 0 else {}


def test_eval_counts_acceptance_by_hand(setup):
    _, _, _, right, wrong = setup
    rc, res = run_eval(setup, right, wrong, check_engine=2)
    assert rc == 0 and res["prompts"] == len(PROMPTS) and res["k"] == K
    r = res["drafts"][str(right)]
    assert r["positions"] == CHAINS * len(PROMPTS)
    assert r["per_position"] == pytest.approx([1.0] * (K - 1) + [AT_LAST_STEP / CHAINS])
    assert r["acceptance_length"] == pytest.approx(K + AT_LAST_STEP / CHAINS)
    assert r["per_sample"] == pytest.approx([K + AT_LAST_STEP / CHAINS] * len(PROMPTS))
    # negative control: a draft that never proposes the verifier's token is accepted nowhere
    w = res["drafts"][str(wrong)]
    assert w["positions"] == r["positions"] and w["per_position"] == [0.0] * K and w["acceptance_length"] == 1.0
    # the real engine agrees on the first two prompts: the always-right draft is accepted at every step
    check = res["engine_check"]
    assert check["draft"] == str(right) and check["engine"] == pytest.approx([1.0 + K] * 2)
    assert check["teacher_forced"] == r["per_sample"][:2]
    png = setup[0] / "eval.png"  # the drafts side by side, beside the JSON
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_eval_reads_its_cache_and_checks_the_first_draft(setup):
    root, _, _, right, wrong = setup
    run_eval(setup, right)
    (cache,) = (root / "cache").iterdir()
    replies = cache / "regenerated.jsonl"
    before = replies.stat().st_mtime_ns, (cache / "shards" / "manifest.json").read_bytes()
    rc, res = run_eval(setup, wrong, right, check_engine=1)
    assert rc == 0 and (replies.stat().st_mtime_ns, (cache / "shards" / "manifest.json").read_bytes()) == before
    assert res["engine_check"]["draft"] == str(wrong) and res["engine_check"]["engine"] == [1.0]
    # another reply budget is another cache, not a stale read of this one
    rc, res = run_eval(setup, right, max_new_tokens=N + 4)
    assert rc == 0 and len(list((root / "cache").iterdir())) == 2
    assert res["drafts"][str(right)]["positions"] == (CHAINS + 4) * len(PROMPTS)


def test_teacher_forced_acceptance_of_a_perfect_and_a_blind_draft():
    """On hand-made samples: a draft that reads the next tokens scores 1 + k, one that never does 1."""
    def sample(ids, n_prompt):
        n = len(ids)
        return {"input_ids": torch.tensor(ids), "loss_mask": torch.arange(n) >= n_prompt,
                "aux": torch.zeros(n, 3), "last": torch.zeros(n, 1)}

    samples = [sample(list(range(10, 20)), 4), sample(list(range(30, 37)), 2)]  # replies of 6 and 5 tokens

    class Oracle(torch.nn.Module):
        draft_to_target = torch.arange(40)

        def __init__(self, blind: bool) -> None:
            super().__init__()
            self.blind = blind

        def forward_ttt(self, aux, input_ids, position_ids, attn_mask, steps):
            # step j at position p reads x_{t+1} = input_ids[p] and predicts x_{t+2+j} = input_ids[p] + 1 + j
            guess = torch.zeros_like(input_ids) if self.blind else input_ids
            return [torch.nn.functional.one_hot(guess + 1 + j, 40).float() for j in range(steps)]

    a = teacher_forced_acceptance(Oracle(blind=False), samples, 2)
    assert a.positions == (6 - 2 + 1) + (5 - 2 + 1) and a.per_position == [1.0, 1.0] and a.acceptance_length == 3.0
    blind = teacher_forced_acceptance(Oracle(blind=True), samples, 2)
    assert blind.positions == a.positions and blind.per_position == [0.0, 0.0] and blind.acceptance_length == 1.0


def test_eval_refuses_bad_input(setup, tmp_path, capsys):
    _, vdir, data, _, _ = setup
    assert main(["eval", "--verifier", str(vdir), "--dataset", str(data)]) == EXIT_ERROR  # no --draft
    assert main(["eval", "--draft", "d", "--num-draft-tokens", "0"]) == EXIT_ERROR
    assert main(["eval", "--verifier", str(vdir), "--draft", str(tmp_path / "missing"), "--dataset", str(data),
                 "--cache", str(tmp_path / "c"), "--max-new-tokens", "4", "--device", "cpu"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "--draft" in err and "--num-draft-tokens" in err and "missing" in err and "Traceback" not in err
