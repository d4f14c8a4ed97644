"""Naming a desync from the ranks' collectives (Flight Recorder entries), and a rank aborted
in C++ from its stderr: pure functions, no process group."""

from pathlib import Path

from ddptrain.resilience.aborts import last_words
from ddptrain.resilience.board import Heartbeat
from ddptrain.resilience.failures import is_users
from ddptrain.resilience.flight import Collective, classify, first_disagreement, in_flight, last_entered
from ddptrain.resilience.hangs import hang_summary, judge_hang, refine

REDUCE4 = Collective("default_pg", 11, "all_reduce", "[4] float32")
GATHER4 = Collective("default_pg", 11, "all_gather", "[4] float32")
REDUCE7 = Collective("default_pg", 11, "all_reduce", "[7] float32")
GRADIENTS = Collective("default_pg", 12, "all_reduce", "[21] float32")


def entry(seq: int, op: str, sizes: list[list[int]], retired: bool, dtype: str = "Float") -> dict:
    """A gloo Flight Recorder entry as torch 2.13 dumps it (the fields read)."""
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": sizes,
            "input_dtypes": [dtype] * len(sizes), "process_group": ["0", "default_pg"], "retired": retired,
            "state": "scheduled", "is_p2p": False}


def test_the_collective_a_rank_is_in_is_its_oldest_unfinished_entry_in_torch_s_names():
    entries = [entry(10, "all_reduce", [[21]], True), entry(11, "all_gather", [[4]], False, "BFloat16"),
               entry(12, "broadcast", [[3], [2, 2]], False)]
    assert in_flight(entries) == Collective("default_pg", 11, "all_gather", "[4] bfloat16")
    assert in_flight(entries[:1]) is None
    assert Collective.decode(REDUCE4.encode()) == REDUCE4 and Collective.decode("") is None
    assert REDUCE4.describe() == "all_reduce #11 ([4] float32)"
    assert last_entered() is None  # no process group in this process: nothing recorded, no error


def test_ranks_in_different_ops_or_shapes_name_the_minority_and_two_ranks_name_both():
    four = classify({0: REDUCE4, 1: GATHER4, 2: REDUCE4, 3: REDUCE4})
    assert four.culprits == [1]
    assert four.reason == ("rank 1 in another op at the same collective: rank 0, 2, 3 in all_reduce #11 "
                           "([4] float32); rank 1 in all_gather #11 ([4] float32)")
    assert classify({0: REDUCE4, 1: REDUCE7, 2: REDUCE4}).culprits == [1]
    assert "in the same op with other shapes" in classify({0: REDUCE4, 1: REDUCE7, 2: REDUCE4}).reason
    assert classify({0: REDUCE4, 1: GATHER4}).culprits == [0, 1]  # no majority: the reader decides
    assert classify({0: REDUCE4, 1: REDUCE4}) is None  # they agree: the collective itself hangs
    assert classify({0: GRADIENTS, 1: REDUCE4, 2: GRADIENTS}).culprits == [1]  # out of step
    assert classify({0: REDUCE4, 1: None}).culprits == [1]  # in none


def test_the_first_collective_called_differently_names_the_culprit_after_gloo_ran_on_out_of_step():
    # Rank 1's [7] all-reduce met the others' [4]; gloo let ranks 0 and 3 on to the gradients'.
    histories = {0: [REDUCE4, GRADIENTS], 1: [REDUCE7], 2: [REDUCE4], 3: [REDUCE4, GRADIENTS]}
    assert first_disagreement(histories).culprits == [1]
    assert first_disagreement({0: [REDUCE4, GRADIENTS], 1: [REDUCE4]}) is None  # rank 1 is behind, not wrong


def beat(collective: Collective | None, arrivals: int = 7, inside: bool = False) -> Heartbeat:
    return Heartbeat(arrivals, inside, "step 5", collective)


def test_a_hang_in_the_task_s_own_collectives_is_judged_by_the_recorder_and_summarised_in_few_lines():
    assert Heartbeat.decode(beat(GATHER4).encode()) == beat(GATHER4)
    seen = {0: (beat(REDUCE4), 0.0), 1: (beat(GATHER4), 0.0), 2: (beat(REDUCE4), 0.0)}
    assert judge_hang(seen, now=3.0, timeout_s=4.0) is None
    verdict = judge_hang(seen, now=5.0, timeout_s=4.0)
    assert verdict["culprits"] == [1] and verdict["waiting"] == [0, 2]
    stacks = {1: "  /me/loss.py:3 in loss: dist.all_gather(out, x)"}
    assert hang_summary(verdict, stacks, 4.0, None).splitlines() == [
        "ddptrain: the ranks' collectives do not match at step 5 (waited --timeout 4 s): rank 1 in another op at "
        "the same collective: rank 0, 2 in all_reduce #11 ([4] float32); rank 1 in all_gather #11 ([4] float32)",
        "ddptrain: rank 1 was in (innermost call last):", stacks[1]]


def test_the_marks_still_name_a_rank_that_never_arrived_and_the_histories_refine_a_verdict():
    seen = {0: (beat(GRADIENTS, 8, True), 0.0), 1: (beat(None, 7), 0.0)}
    verdict = judge_hang(seen, now=5.0, timeout_s=4.0)
    assert verdict["culprits"] == [1] and "desync" not in verdict
    assert "rank 0 waited there in all_reduce #12 ([21] float32)." in hang_summary(verdict, {}, 4.0, None)
    refined = refine(verdict, {0: [REDUCE4, GRADIENTS], 1: [REDUCE7], 2: [REDUCE4]})
    assert refined["culprits"] == [1] and refined["waiting"] == [0] and "other shapes" in refined["desync"]
    assert refine(verdict, {0: [REDUCE4, GRADIENTS], 1: [REDUCE7]})["culprits"] == [0, 1]  # no majority of two
    assert refine(verdict, {0: [REDUCE4], 1: [REDUCE4]}) == verdict


ABORTED = """[W1204 07:48:46] Warning: something earlier (function operator())
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length \
<= op.nbytes. 24 vs 4. Received data size doesn't match expected size. Is there a distributed collective mismatch?
Fatal Python error: Aborted

Thread 0x00007fc1ccde86c0 (most recent call first):
  File "/venv/lib/python3.11/site-packages/ddptrain/resilience/watchdog.py", line 130 in _run

Thread 0x00007fc1f064e740 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/me/project/loss.py", line 12 in extra
  File "/home/me/project/loss.py", line 30 in loss
  File "/venv/lib/python3.11/site-packages/ddptrain/step.py", line 187 in _loss

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


def test_a_rank_aborted_by_gloo_is_named_by_its_reason_its_collective_and_its_own_frames(tmp_path):
    stderr = tmp_path / "rank-1.stderr"
    stderr.write_text(ABORTED)
    words = last_words(stderr, is_users)
    assert words.reason.startswith("op.preamble.length <= op.nbytes. 24 vs 4. Received data size doesn't match")
    assert words.call == "all_reduce"
    assert words.frames == ["/home/me/project/loss.py:30 in loss", "/home/me/project/loss.py:12 in extra"]
    stderr.write_text("[W1204] only a warning\n")
    assert last_words(stderr, is_users) is None
    assert last_words(Path(tmp_path / "absent"), is_users) is None
