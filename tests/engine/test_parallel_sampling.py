"""The fan-out shared by the offline API and the server: child ids, child params, gathering outputs."""

from __future__ import annotations

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from llmsched.engine.parallel_sampling import ParentRequest, child_params, child_request_id


def out(child: int, text: str, finished: bool) -> RequestOutput:
    """One child's output as its RequestState makes it (under the child's id, its own index)."""
    reason = "length" if finished else None
    completion = CompletionOutput(index=child, text=text, token_ids=[], finish_reason=reason)
    return RequestOutput(f"{child}_p", None, [1, 2], [completion], finished)


def test_children_are_named_as_vllm_names_them() -> None:
    assert [child_request_id(i, "req-7") for i in range(3)] == ["0_req-7", "1_req-7", "2_req-7"]


def test_seeded_children_get_seed_plus_index_and_n_1() -> None:
    params = SamplingParams(n=3, seed=40, temperature=0.8, max_tokens=5)
    kids = [child_params(params, i) for i in range(3)]
    assert [k.seed for k in kids] == [40, 41, 42]
    assert all(k.n == 1 and k.temperature == 0.8 and k.max_tokens == 5 for k in kids)
    # The parent's own params are left as they were.
    assert params.n == 3 and params.seed == 40


def test_unseeded_children_keep_no_seed() -> None:
    params = SamplingParams(n=2, temperature=0)
    assert [(k.n, k.seed) for k in (child_params(params, 0), child_params(params, 1))] == [
        (1, None),
        (1, None),
    ]
    single = SamplingParams()
    assert child_params(single, 0) is single


def test_final_only_waits_for_every_child_and_sorts_by_index() -> None:
    parent = ParentRequest("p", 3, RequestOutputKind.FINAL_ONLY)
    # Children finish out of index order.
    assert parent.child_output("2_p", out(2, "c", True)) is None
    assert parent.child_output("0_p", out(0, "a", True)) is None
    assert not parent.finished
    final = parent.child_output("1_p", out(1, "b", True))
    assert final is not None and final.finished and parent.finished
    assert final.request_id == "p"
    assert [(c.index, c.text) for c in final.outputs] == [(0, "a"), (1, "b"), (2, "c")]


def test_streaming_reports_each_child_and_finishes_with_the_last() -> None:
    parent = ParentRequest("p", 2, RequestOutputKind.DELTA)
    first = parent.child_output("1_p", out(1, "x", False))
    assert first is not None and first.request_id == "p" and not first.finished
    assert [c.index for c in first.outputs] == [1]
    done1 = parent.child_output("1_p", out(1, "y", True))
    assert done1 is not None and not done1.finished  # child 0 still runs
    # A child's final output is reported once.
    assert parent.child_output("1_p", out(1, "", True)) is None
    done0 = parent.child_output("0_p", out(0, "z", True))
    assert done0 is not None and done0.finished and [c.index for c in done0.outputs] == [0]
    assert parent.finished and list(parent.live) == []
