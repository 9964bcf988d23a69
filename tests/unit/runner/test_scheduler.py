"""Scheduler behaviour with a fake model step: no mlx, hand-made results."""

from mlxr.runner.request import Sequence, SeqStatus
from mlxr.runner.scheduler import Scheduler, SchedulerConfig, StepResult
from mlxr.shared.protocol import Options

EOS = 99


def make_seq(seq_id, prompt_len, max_new=5, ctx=1000):
    return Sequence(seq_id=seq_id, prompt_tokens=list(range(1, prompt_len + 1)), options=Options(),
                    max_new_tokens=max_new, context_length=ctx)


class FakeModelStep:
    """Returns token 7 for every sequence that should get one; prefix hits from a table."""

    def __init__(self, cached=None):
        self.cached = cached or {}
        self.released = []

    def admit(self, seq):
        return self.cached.get(seq.seq_id, 0)

    def run(self, plan, token=7):
        self.released += [s.seq_id for s in plan.release]
        result = StepResult()
        for seq in plan.decode:
            result.tokens[seq.seq_id] = token
        for chunk in plan.prefills:
            if chunk.is_last:
                result.tokens[chunk.seq.seq_id] = token
        return result


def make(config=None, cached=None):
    step = FakeModelStep(cached)
    return Scheduler(config or SchedulerConfig(), step.admit, {EOS}), step


def chunk_len(plan):
    [chunk] = plan.prefills
    return chunk.end - chunk.start


def run_step(sched, step, token=7):
    plan = sched.schedule()
    result = step.run(plan, token)
    return plan, sched.update(plan, result)


def test_scheduler_and_prefix_cache_import_no_mlx():
    import ast

    from mlxr.runner import prefix_cache, request, scheduler

    for mod in (scheduler, prefix_cache, request):
        tree = ast.parse(open(mod.__file__).read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] in ("mlx", "mlx_lm")], mod.__name__


def test_long_prompt_is_prefilled_in_chunks_while_others_decode():
    sched, step = make(SchedulerConfig(prefill_chunk=100, step_token_budget=104,
                                       min_prefill_chunk=8))
    short = make_seq(1, 10, max_new=50)
    sched.add(short)
    run_step(sched, step)  # short prefills in one chunk and gets its first token
    assert sched.running == [short] and short.output_tokens == [7]
    long = make_seq(2, 250)
    sched.add(long)
    chunks = []
    while long.status != SeqStatus.RUNNING:
        plan, _ = run_step(sched, step)
        assert plan.decode == [short], "the running stream decodes in every step"
        [chunk] = plan.prefills
        chunks.append((chunk.start, chunk.end))
    assert chunks == [(0, 100), (100, 200), (200, 250)]
    assert long.num_computed == 250 and long.output_tokens == [7]
    assert len(short.output_tokens) == 4


def test_step_budget_shrinks_prefill_chunk_but_not_below_minimum():
    sched, step = make(SchedulerConfig(max_running=64, prefill_chunk=512, step_token_budget=40,
                                       min_prefill_chunk=16))
    for i in range(30):
        seq = make_seq(i, 1, max_new=100)
        sched.add(seq)
        while seq.status != SeqStatus.RUNNING:
            run_step(sched, step)
    sched.add(make_seq(100, 400))
    plan = sched.schedule()
    assert len(plan.decode) == 30
    assert chunk_len(plan) == 16


def test_prefix_hit_starts_prefill_after_cached_tokens():
    sched, step = make(cached={1: 40})
    seq = make_seq(1, 50)
    sched.add(seq)
    plan = sched.schedule()
    assert [(c.start, c.end) for c in plan.prefills] == [(40, 50)]
    assert seq.num_cached == 40


def test_length_limit_and_eos_finish_and_release_once():
    sched, step = make()
    a, b = make_seq(1, 3, max_new=2), make_seq(2, 3, max_new=10)
    sched.add(a)
    sched.add(b)
    released = []
    for _ in range(3):
        plan, _ = run_step(sched, step)
        released += [s.seq_id for s in plan.release]
    assert a.status == SeqStatus.FINISHED_LENGTH and a.done_reason == "length"
    assert a.output_tokens == [7, 7]
    assert b.status == SeqStatus.RUNNING
    plan, touched = run_step(sched, step, token=EOS)
    released += [s.seq_id for s in plan.release]
    assert b in touched and b.status == SeqStatus.FINISHED_STOPPED and EOS not in b.output_tokens
    plan = sched.schedule()
    released += [s.seq_id for s in plan.release]
    assert released == [1, 2]
    assert not plan.has_compute and not sched.has_work


def test_context_length_stops_generation():
    sched, step = make()
    seq = make_seq(1, 8, max_new=1000, ctx=12)
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched, step)
    assert seq.num_tokens == 12 and seq.done_reason == "length"


def test_cancel_removes_from_batch_at_next_step():
    sched, step = make(SchedulerConfig(max_running=8))
    seqs = [make_seq(i, 4, max_new=100) for i in range(4)]
    for s in seqs:
        sched.add(s)
    while len(sched.running) < 4:
        run_step(sched, step)
    sched.cancel(seqs[1])
    sched.cancel(seqs[3])
    plan, _ = run_step(sched, step)
    assert sorted(s.seq_id for s in plan.release) == [1, 3]
    assert plan.decode == [seqs[0], seqs[2]]
    assert seqs[1].status == SeqStatus.FINISHED_CANCELLED
    assert sched.num_active == 2


def test_cancel_while_waiting_never_admits():
    sched, step = make(SchedulerConfig(max_running=1))
    a, b = make_seq(1, 4, max_new=100), make_seq(2, 4)
    sched.add(a)
    sched.add(b)
    run_step(sched, step)
    sched.cancel(b)
    plan, _ = run_step(sched, step)
    assert b in plan.release and b.status == SeqStatus.FINISHED_CANCELLED
    assert sched.num_waiting == 0


def test_max_running_limits_admission():
    sched, step = make(SchedulerConfig(max_running=2))
    for i in range(5):
        sched.add(make_seq(i, 3, max_new=100))
    for _ in range(10):
        run_step(sched, step)
    assert len(sched.running) == 2 and sched.num_waiting == 3


def test_kv_budget_preempts_newest_and_requeues_it():
    sched, step = make(SchedulerConfig(max_running=8, kv_token_budget=30))
    a, b = make_seq(1, 10, max_new=100), make_seq(2, 10, max_new=100)
    sched.add(a)
    sched.add(b)
    while b.status != SeqStatus.RUNNING:
        run_step(sched, step)
    preempted = False
    for _ in range(10):
        plan, _ = run_step(sched, step)
        if b in plan.release:
            preempted = True
            break
    assert preempted and b.status in (SeqStatus.PREEMPTED, SeqStatus.PREFILLING)
    assert b.num_computed == 0 or b.status == SeqStatus.PREFILLING
    assert a in sched.running and not a.is_finished
    # b comes back: its prefill now covers prompt and the output it had.
    produced = len(b.output_tokens)
    assert produced > 0
    assert sched.waiting and sched.waiting[0] is b or b in sched.prefilling


def test_failed_sequence_finishes_with_error_others_continue():
    sched, step = make()
    a, b = make_seq(1, 3, max_new=100), make_seq(2, 3, max_new=100)
    for s in (a, b):
        sched.add(s)
    while b.status != SeqStatus.RUNNING:
        run_step(sched, step)
    plan = sched.schedule()
    result = step.run(plan)
    result.failed[1] = "boom"
    del result.tokens[1]
    touched = sched.update(plan, result)
    assert a in touched and a.status == SeqStatus.FINISHED_ERROR and a.error == "boom"
    assert b.status == SeqStatus.RUNNING


def test_prefill_chunk_is_sized_by_measured_step_times_while_streams_decode():
    sched, step = make(SchedulerConfig(prefill_chunk=512, min_prefill_chunk=16,
                                       stall_factor=1.0))
    runner = make_seq(1, 4, max_new=1000)
    sched.add(runner)
    run_step(sched, step)
    for _ in range(3):  # decode-only steps take 40 ms
        plan, _ = run_step(sched, step)
        sched.observe(plan, 0.040)
    long = make_seq(2, 3000)
    sched.add(long)
    plan = sched.schedule()
    assert chunk_len(plan) == 512, "no prefill measurement yet"
    sched.observe(plan, 0.040 + 512 * 0.001)  # 1 ms per prompt token
    sched.update(plan, step.run(plan))
    plan = sched.schedule()
    # One decode step's time (40 ms) buys 40 prompt tokens at 1 ms each.
    assert chunk_len(plan) == 40
    assert plan.decode == [runner]


def test_prefill_alone_uses_the_full_chunk():
    sched, step = make(SchedulerConfig(prefill_chunk=256))
    seq = make_seq(1, 1000)
    sched.add(seq)
    plan = sched.schedule()
    sched.observe(plan, 0.5)
    sched.update(plan, step.run(plan))
    plan = sched.schedule()
    assert chunk_len(plan) == 256


def test_short_prompts_arriving_together_prefill_in_one_step():
    sched, step = make(SchedulerConfig(prefill_chunk=256, max_running=16))
    seqs = [make_seq(i, 30, max_new=10) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    # 256 tokens of allowance: eight 30-token prompts whole, the ninth in part.
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == \
        [(i, 0, 30) for i in range(8)] + [(8, 0, 16)]
    touched = sched.update(plan, step.run(plan))
    assert [s.seq_id for s in sched.running] == list(range(8))
    assert all(s.output_tokens == [7] for s in touched)
    plan = sched.schedule()
    assert plan.decode == seqs[:8]
    assert [(c.seq.seq_id, c.start) for c in plan.prefills][:1] == [(8, 16)]


def test_short_prompts_are_not_throttled_while_streams_decode():
    sched, step = make(SchedulerConfig(prefill_chunk=512, min_prefill_chunk=16,
                                       stall_factor=1.0, long_prompt_tokens=300))
    sched.add(make_seq(1, 4, max_new=1000))
    run_step(sched, step)
    for _ in range(3):
        plan, _ = run_step(sched, step)
        sched.observe(plan, 0.040)
    sched.timer.prefill_token_s = 0.001  # 40 tokens fit in one decode step's time
    sched.add(make_seq(2, 200))
    plan = sched.schedule()
    assert chunk_len(plan) == 200, "a short prompt goes in whole"


def test_chunks_do_not_shrink_to_the_minimum_when_each_chunk_has_a_fixed_cost():
    # A chunk costs 9 ms plus 0.26 ms a token (its own forward pass); decode steps 24 ms.
    # Read as a cost per token, every smaller chunk looks dearer and the next one shrinks,
    # down to min_prefill_chunk; fitted as fixed + per token, chunks settle where the step
    # stays within 0.75 decode steps of extra time: (18 - 9) / 0.26 = 34 tokens.
    sched, step = make(SchedulerConfig(prefill_chunk=512, min_prefill_chunk=16,
                                       stall_factor=0.75))
    sched.add(make_seq(1, 4, max_new=100_000))
    run_step(sched, step)
    for _ in range(3):
        plan, _ = run_step(sched, step)
        sched.observe(plan, 0.024)
    sched.add(make_seq(2, 20_000))
    sizes = []
    for _ in range(40):
        plan = sched.schedule()
        sizes.append(chunk_len(plan))
        sched.observe(plan, 0.024 + 0.009 + 0.00026 * sizes[-1])
        sched.update(plan, step.run(plan))
    assert sizes[0] == 512, "no prefill measurement yet"
    assert all(33 <= n <= 35 for n in sizes[-20:]), str(sizes)
    extra = [0.009 + 0.00026 * n for n in sizes[-20:]]
    assert max(extra) <= 0.75 * 0.024 + 1e-9
