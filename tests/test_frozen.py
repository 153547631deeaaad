"""Frozen CPU graphs share equal constants (decoding/frozen.py): one packed copy of the weights."""

from __future__ import annotations

import gc

import torch
from conftest import tiny_model

from draftsmith.decoding import frozen
from draftsmith.decoding import runner as runner_mod
from draftsmith.decoding.runner import verifier_runner


def _graph(constants: dict[str, torch.Tensor], frozen_params: bool = True):
    """A stand-in for a compiled graph: what share_frozen_constants reads of one."""
    from torch._inductor.output_code import CompiledFxGraph

    g = object.__new__(CompiledFxGraph)
    g.constants = constants
    g.frozen_param_names = {"w": "p"} if frozen_params else {}
    g.compiled_fn_runner = None  # read when it is freed
    return g


def test_share_moves_equal_constants_and_leaves_the_rest(monkeypatch):
    """An equal constant of a later frozen graph (a view of a base, as inductor makes them) moves onto
    the first one's storage, values unchanged, its base too; a constant of the same checksum but other
    bytes stays, and one equal to *it* later moves onto it (the pool keeps every content of a key); one
    a module's parameter holds stays; a graph that did not freeze is not touched; with the setting off
    nothing moves (the negative control)."""
    monkeypatch.setenv("DRAFTSMITH_SHARE_CONSTANTS", "1")
    torch.manual_seed(0)
    first = torch.randn(3 * 4096)
    base = first.reshape(3, -1).clone()
    later = base.view(-1)  # a view: its base must move too, or the old storage stays alive
    odd = first.clone()
    words = odd.view(torch.int32)
    words[1], words[2] = words[2].clone(), words[1].clone()  # same sums (neither index a multiple of 97)
    assert frozen._key(odd.untyped_storage()) == frozen._key(first.untyped_storage()) and not torch.equal(odd, first)
    odd_again = odd.clone()
    module = torch.nn.Linear(1, 1)
    module.weight = torch.nn.Parameter(first.clone(), requires_grad=False)
    held = module.weight.detach()
    unfrozen = first.clone()
    graphs = [_graph({"w": first})]
    frozen.share_frozen_constants()  # the first graph: registered
    graphs += [_graph({"w": later}), _graph({"w": odd}), _graph({"w": held}), _graph({"w": unfrozen}, False)]
    freed = frozen.share_frozen_constants()
    ptr = first.untyped_storage().data_ptr()
    assert later.untyped_storage().data_ptr() == ptr and base.untyped_storage().data_ptr() == ptr
    assert torch.equal(later, first) and torch.equal(base.view(-1), first)
    assert freed == first.nbytes
    assert odd.untyped_storage().data_ptr() != ptr
    assert held.untyped_storage().data_ptr() == module.weight.untyped_storage().data_ptr() != ptr
    assert unfrozen.untyped_storage().data_ptr() != ptr
    graphs.append(_graph({"w": odd_again}))
    assert frozen.share_frozen_constants() == odd.nbytes
    assert odd_again.untyped_storage().data_ptr() == odd.untyped_storage().data_ptr()
    # the first graph gone, its memory lives on in the later one's constant, still a target
    again = first.clone()
    del graphs[0], first
    gc.collect()
    graphs.append(_graph({"w": later.clone()}))
    assert frozen.share_frozen_constants() == later.nbytes
    assert graphs[-1].constants["w"].untyped_storage().data_ptr() == ptr
    # the negative control: off, an equal constant of a new graph keeps its own memory
    monkeypatch.setenv("DRAFTSMITH_SHARE_CONSTANTS", "0")
    graphs.append(_graph({"w": again}))
    assert frozen.share_frozen_constants() == 0 and again.untyped_storage().data_ptr() != ptr
    # ... and stays apart when sharing is on again (a graph compiled while off keeps its own copies)
    monkeypatch.setenv("DRAFTSMITH_SHARE_CONSTANTS", "1")
    assert frozen.share_frozen_constants() == 0 and again.untyped_storage().data_ptr() != ptr
    del graphs
    gc.collect()


def _new_frozen_graphs(before: set[int]) -> list:
    return [g for g in frozen.compiled_graphs(frozen_only=True) if id(g) not in before]


def _frozen_ids() -> set[int]:
    return {id(g) for g in _new_frozen_graphs(set())}


def test_compiled_steps_hold_one_copy_of_the_packed_weights(monkeypatch):
    """A model's frozen one-token and verify graphs: compiled with sharing off, each holds its own
    packed weights (the negative control); on, the verify graph's constants are the one-token graph's
    memory, and both steps compute bitwise what they computed with their own copies."""
    monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", "template")  # frozen candidates only
    model = tiny_model("llama", layers=2, seed=11)
    out, shared = {}, {}
    for share in ("0", "1"):
        monkeypatch.setenv("DRAFTSMITH_SHARE_CONSTANTS", share)
        runner_mod._COMPILED.pop(model, None)  # graphs of its own
        before = _frozen_ids()
        with torch.inference_mode():  # the steps' tensors made inside it, as generate makes them: no recompile
            prompt, nxt, draft = torch.arange(9) + 3, torch.tensor([7]), torch.tensor([5, 9, 2])
            r = verifier_runner(model, 64, compile=True, warmup_shapes=(1, 2))
            r.forward(prompt, 1)
            out[share] = [r.forward(nxt, 1)[0], r.forward(draft, 3)[0], r.forward(nxt, 1)[0]]
        graphs = _new_frozen_graphs(before)
        assert len(graphs) == 2  # the one-token step and the verify step
        one, verify = graphs
        ptrs = {t.untyped_storage().data_ptr() for t in one.constants.values()}
        equal = [t for t in verify.constants.values()
                 if any(torch.equal(frozen._bytes(t.untyped_storage()), frozen._bytes(u.untyped_storage()))
                        for u in one.constants.values())]
        assert len(equal) >= 2 * 7 + 1  # every projection's packed weight, and the head's
        shared[share] = sum(t.untyped_storage().data_ptr() in ptrs for t in equal)
        if share == "1":
            assert shared[share] == len(equal)  # every equal constant: one memory
        runner_mod._COMPILED.pop(model)
        del r, graphs
        gc.collect()
    assert shared["0"] == 0
    for a, b in zip(out["0"], out["1"]):
        assert torch.equal(a, b)
