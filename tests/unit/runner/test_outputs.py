"""The runner's output seam with no mlx: the scheduler decides finishing (EOS, length, stop
strings through `Outputs.stop_matched`), `Outputs.chunks` turns a step into lines, and
`Scheduler.abort` fails sequences. Model results are hand-made."""

import ast

from mlxr.runner.outputs import Outputs
from mlxr.runner.request import SeqStatus, make_sequence
from mlxr.runner.kv.pool import KVPool
from mlxr.runner.scheduler import Scheduler, SchedulerConfig, StepResult
from mlxr.shared.protocol import Options

EOS = 99
PIECES = {1: "a", 2: "b", 3: "ST", 4: "OP", 5: "c"}


def decode(ids):
    return "".join(PIECES.get(i, "?") for i in ids)


def make(num_predict=-1, stop=None, ctx=100, return_prompt_tokens=False):
    outputs = Outputs(decode)
    sched = Scheduler(SchedulerConfig(), KVPool(1 << 20, block_size=1, share=False),
                      lambda seq, admission: 0, {EOS}, outputs.stop_matched)
    seq = make_sequence(1, [1, 2], Options(num_predict=num_predict, stop=stop or []), ctx,
                        False, 0, sink=None, return_prompt_tokens=return_prompt_tokens)
    outputs.open(seq)
    sched.add(seq)
    return sched, outputs, seq


def step(sched, outputs, token):
    plan = sched.schedule()
    result = StepResult(tokens={s.seq_id: token for s in
                                list(plan.decode) + [c.seq for c in plan.prefills]})
    return plan, [item for _, item in outputs.chunks(sched.update(plan, result), result)]


def test_outputs_and_step_timer_import_no_mlx():
    from mlxr.runner import outputs, step_timer

    for mod in (outputs, step_timer):
        tree = ast.parse(open(mod.__file__).read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] in ("mlx", "mlx_lm")], mod.__name__


def test_stop_string_finishes_in_the_scheduler_and_is_not_sent():
    sched, outputs, seq = make(stop=["STOP"])
    lines = []
    for token in (1, 3, 4, 5):
        if seq.is_finished:
            break
        lines += step(sched, outputs, token)[1]
    assert seq.status == SeqStatus.FINISHED_STOPPED and seq.output_tokens == [1, 3, 4]
    assert "".join(line["content"] for line in lines) == "a"
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    assert [t for line in lines for t in line["tokens"]] == [1, 3, 4]
    plan = sched.schedule()
    assert plan.release == [seq] and not sched.has_work


def test_length_wins_when_the_last_token_also_completes_a_stop_string():
    sched, outputs, seq = make(num_predict=2, stop=["STOP"])
    _, first = step(sched, outputs, 3)
    _, last = step(sched, outputs, 4)
    assert first[0]["content"] == "" and not first[0]["done"]
    assert last[0]["done"] and last[0]["done_reason"] == "length" and last[0]["content"] == ""


def test_eos_is_not_output_and_held_back_text_is_flushed():
    sched, outputs, seq = make(stop=["STOP"])
    _, first = step(sched, outputs, 3)  # "ST" could start the stop string: held back
    _, last = step(sched, outputs, EOS)
    assert first[0]["content"] == ""
    assert last[0]["content"] == "ST" and last[0]["done_reason"] == "stop"
    assert last[0]["tokens"] == [] and seq.output_tokens == [3]


def test_abort_fails_sequences_once_with_an_error_line():
    sched, outputs, seq = make()
    step(sched, outputs, 1)
    assert sched.in_flight == [seq]
    aborted = sched.abort(sched.in_flight, "inference failed: boom")
    assert aborted == [seq] and seq.status == SeqStatus.FINISHED_ERROR
    assert sched.abort([seq], "again") == []
    [(_, line)] = outputs.chunks(aborted, StepResult())
    assert line["error"] == {"message": "inference failed: boom", "status": 500,
                             "kind": "runner_failed"}
    assert sched.schedule().release == [seq] and not sched.has_work


def test_only_the_final_chunk_carries_the_prompt_ids_and_only_when_asked():
    for asked in (False, True):
        sched, outputs, seq = make(num_predict=2, return_prompt_tokens=asked)
        _, first = step(sched, outputs, 1)
        _, last = step(sched, outputs, 2)
        assert "prompt_tokens" not in first[0] and last[0]["done"]
        assert last[0].get("prompt_tokens") == ([1, 2] if asked else None)
