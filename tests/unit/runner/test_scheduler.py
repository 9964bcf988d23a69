"""Scheduler behaviour with a fake model step: no mlx, hand-made results."""

import math

from mlxr.runner.kv.pool import KVPool
from mlxr.runner.request import Sequence, SeqStatus
from mlxr.runner.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult
from mlxr.shared.protocol import Options

EOS = 99


def make_seq(seq_id, prompt_len, max_new=5, ctx=1000, shift=True, num_keep=4):
    return Sequence(seq_id=seq_id, prompt_tokens=list(range(1, prompt_len + 1)), options=Options(),
                    max_new_tokens=max_new, context_length=ctx, shift=shift, num_keep=num_keep)


class FakeModelStep:
    """Returns token 7 for every sequence that should get one; prefix hits from a table."""

    def __init__(self, cached=None):
        self.cached = cached or {}
        self.released = []

    def admit(self, seq, admission):
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


def token_pool(kv_tokens=1 << 20):
    """Blocks of one token, no sharing: the budget counts tokens exactly."""
    return KVPool(kv_tokens, block_size=1, share=False)


def make(config=None, cached=None, kv_tokens=1 << 20):
    step = FakeModelStep(cached)
    return Scheduler(config or SchedulerConfig(), token_pool(kv_tokens), step.admit, {EOS}), step


def chunk_len(plan):
    [chunk] = plan.prefills
    return chunk.end - chunk.start


def run_step(sched, step, token=7):
    plan = sched.schedule()
    result = step.run(plan, token)
    return plan, sched.update(plan, result)


def test_scheduler_and_prefix_cache_import_no_mlx():
    import ast

    from mlxr.runner import request, scheduler
    from mlxr.runner.kv import pool, prefix_cache

    for mod in (scheduler, prefix_cache, request, pool):
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


def test_context_length_stops_generation_without_shift():
    sched, step = make()
    seq = make_seq(1, 8, max_new=1000, ctx=12, shift=False)
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched, step)
    assert seq.num_tokens == 12 and seq.done_reason == "length"


class CountingStep(FakeModelStep):
    """Emits 100, 101, ... and records what each admission had to compute."""

    def __init__(self):
        super().__init__()
        self.next = 100
        self.admitted = []  # (seq_id, context at admission)
        self.live = set()

    def admit(self, seq, admission):
        assert seq.seq_id not in self.live, "admitted before its old cache was released"
        self.live.add(seq.seq_id)
        self.admitted.append((seq.seq_id, list(seq.all_tokens)))
        return 0

    def run(self, plan, token=None):
        for s in plan.release:
            self.live.discard(s.seq_id)
        result = StepResult()
        for seq in plan.decode + [c.seq for c in plan.prefills if c.is_last]:
            result.tokens[seq.seq_id] = self.next
            self.next += 1
        return result


def test_context_shift_keeps_num_keep_drops_half_and_goes_on():
    step = CountingStep()
    sched = Scheduler(SchedulerConfig(), token_pool(), step.admit, {EOS})
    seq = make_seq(1, 8, max_new=30, ctx=12, num_keep=2)
    sched.add(seq)
    while not seq.is_finished:
        plan = sched.schedule()
        sched.update(plan, step.run(plan))
    # The whole output, past the context: the reply went on after each shift.
    assert seq.output_tokens == list(range(100, 130)) and seq.done_reason == "length"
    prompt = list(range(1, 9))
    first_shift = step.admitted[1][1]
    # Full at 12 tokens (8 + 4 out): keep 2, drop (12 - 2) // 2 = 5, recompute the other 7.
    assert first_shift == prompt[:2] + (prompt + [100, 101, 102, 103])[7:]
    assert len(step.admitted) > 3 and all(len(ctx) == 7 for _, ctx in step.admitted[1:])
    assert seq.all_tokens[:2] == [1, 2] and seq.all_tokens[-1] == 129
    assert seq.num_tokens < 12


def test_context_shift_with_num_keep_minus_one_keeps_the_prompt():
    step = CountingStep()
    sched = Scheduler(SchedulerConfig(), token_pool(), step.admit, {EOS})
    seq = make_seq(1, 6, max_new=12, ctx=10, num_keep=-1)
    sched.add(seq)
    while not seq.is_finished:
        plan = sched.schedule()
        sched.update(plan, step.run(plan))
    assert all(ctx[:6] == list(range(1, 7)) for _, ctx in step.admitted)
    assert len(seq.output_tokens) == 12


def test_context_shift_does_not_disturb_other_streams():
    step = CountingStep()
    sched = Scheduler(SchedulerConfig(), token_pool(), step.admit, {EOS})
    short = make_seq(1, 8, max_new=20, ctx=12)
    other = make_seq(2, 3, max_new=20, ctx=100)
    sched.add(short)
    sched.add(other)
    while not (short.is_finished and other.is_finished):
        plan = sched.schedule()
        sched.update(plan, step.run(plan))
    assert len(short.output_tokens) == 20 and len(other.output_tokens) == 20
    assert [sid for sid, _ in step.admitted].count(2) == 1  # never recomputed


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
    sched, step = make(SchedulerConfig(max_running=8), kv_tokens=30)
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
    # Nothing decodes: the burst gets the whole step budget, not the 64-token chunk.
    sched, step = make(SchedulerConfig(prefill_chunk=64, step_token_budget=256,
                                       max_running=16))
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
    # streams decode now, but the burst goes on until its prompts have all started
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == \
        [(8, 16, 30), (9, 0, 30), (10, 0, 30), (11, 0, 30)]
    sched.update(plan, step.run(plan))
    sched.add(make_seq(12, 30))
    sched.add(make_seq(13, 30))
    plan = sched.schedule()  # a later arrival beside twelve streams: the chunk allowance
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == \
        [(12, 0, 30), (13, 0, 30)]


def test_a_burst_larger_than_the_decoding_batch_starts_in_one_step():
    sched, step = make(SchedulerConfig(prefill_chunk=64, step_token_budget=1024))
    first = make_seq(0, 30, max_new=50)
    sched.add(first)
    run_step(sched, step)  # the first arrival starts alone, then decodes
    assert sched.running == [first]
    for i in range(1, 11):
        sched.add(make_seq(i, 30))
    plan = sched.schedule()
    assert plan.decode == [first]
    assert [(c.seq.seq_id, c.end) for c in plan.prefills] == [(i, 30) for i in range(1, 11)]


def test_a_long_prompt_in_a_burst_keeps_the_chunk_size():
    sched, step = make(SchedulerConfig(prefill_chunk=64, step_token_budget=256,
                                       long_prompt_tokens=100))
    for i, n in enumerate((30, 30, 400)):
        sched.add(make_seq(i, n))
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.end) for c in plan.prefills] == [(0, 30), (1, 30), (2, 4)]


def stream_decoding_40ms_steps(sched, step) -> None:
    """One stream decoding, its steps measured at 40 ms, and prefill at 1 ms a token: 40
    prompt tokens fit in one decode step's time."""
    sched.add(make_seq(1, 4, max_new=1000))
    run_step(sched, step)
    for _ in range(3):
        plan, _ = run_step(sched, step)
        sched.observe(plan, 0.040)
    sched.timer.prefill_token_s = 0.001


def test_short_prompts_are_not_throttled_while_streams_decode():
    sched, step = make(SchedulerConfig(prefill_chunk=512, min_prefill_chunk=16,
                                       stall_factor=1.0, long_prompt_tokens=300))
    stream_decoding_40ms_steps(sched, step)
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



# -- out of memory -------------------------------------------------------------------------------

def test_a_sequence_alone_that_outgrows_the_kv_budget_fails_with_insufficient_memory():
    from mlxr.shared.errors import InsufficientMemory

    sched, step = make(kv_tokens=12)
    assert sched.fits(11) and not sched.fits(12)
    seq = make_seq(1, 8, max_new=100, ctx=1000)
    sched.add(seq)
    touched = []
    while not seq.is_finished:
        touched += run_step(sched, step)[1]
    assert seq.status == SeqStatus.FINISHED_ERROR and isinstance(seq.error, InsufficientMemory)
    assert seq.error.status == 507 and "12 tokens" in seq.error.message
    # It fails when its 13th position does not fit (the 12th did).
    assert seq.num_tokens == 13 and touched[-1] is seq  # its error line goes out
    assert step.released == [1] and not sched.has_work


def test_prefilling_sequences_make_room_for_a_running_one():
    sched, step = make(SchedulerConfig(prefill_chunk=4, min_prefill_chunk=4,
                                       step_token_budget=5), kv_tokens=20)
    first = make_seq(1, 4, max_new=12)
    sched.add(first)
    run_step(sched, step)
    assert first in sched.running
    late = make_seq(2, 12, max_new=2)
    sched.add(late)
    while not (first.is_finished and late.is_finished):
        run_step(sched, step)
        assert sched.pool.used_blocks <= 20
    assert first.done_reason == "length" and late.done_reason == "length"


def test_recover_fails_the_growing_sequences_and_the_rest_recompute():
    step = CountingStep()
    sched = Scheduler(SchedulerConfig(prefill_chunk=64), token_pool(), step.admit, {EOS})
    running = [make_seq(i, 4, max_new=6) for i in (1, 2)]
    for seq in running:
        sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, step.run(plan))
    big = make_seq(3, 40, max_new=3)
    sched.add(big)
    plan = sched.schedule()
    assert [c.seq for c in plan.prefills] == [big] and plan.decode == running
    step.live.clear()  # the model step lost every cache
    failed = sched.recover(plan, MemoryError("[malloc] out of memory"))
    assert failed == [big] and big.error.status == 507
    assert all(s.status == SeqStatus.PREEMPTED and s.num_computed == 0 for s in running)
    while not all(s.is_finished for s in running):
        plan = sched.schedule()
        sched.update(plan, step.run(plan))
    assert all(s.done_reason == "length" and len(s.output_tokens) == 6 for s in running)
    other = sched.recover(StepPlan(), RuntimeError("a bug"))
    assert other == []


def test_a_long_history_mostly_cached_is_not_a_long_prompt():
    # A chat's next turn resends 400 tokens of which 320 are in the prefix cache: 80 to read,
    # in one chunk beside a decoding stream, where 400 uncached ones are throttled.
    pool = KVPool(1 << 12, block_size=16)
    history = list(range(1000, 1320))
    assert pool.admit(900, history, len(history)) is not None
    pool.release(900, history, len(history))  # a finished turn: its blocks stay cached
    step = FakeModelStep(cached={2: 320})
    sched = Scheduler(SchedulerConfig(prefill_chunk=512, min_prefill_chunk=16, stall_factor=1.0,
                                      long_prompt_tokens=300, probe_after_s=math.inf),
                      pool, step.admit, {EOS})
    stream_decoding_40ms_steps(sched, step)  # one row's steps; two rows' are read off them
    turn = Sequence(seq_id=2, prompt_tokens=history + list(range(1, 81)), options=Options(),
                    max_new_tokens=5, context_length=1000, shift=True, num_keep=4)
    sched.add(turn)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [(2, 320, 400)]
    # the same length with nothing cached is a long prompt: read in timed chunks
    sched.add(make_seq(3, 400))
    sched.update(plan, step.run(plan))
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.end - c.start) for c in plan.prefills] == [(3, 40)]


def test_a_burst_starts_in_passes_of_burst_tokens():
    # sixteen chat turns of 100 new tokens arrive while one stream decodes: half start in
    # the first step; then the streams decoding outnumber those waiting, and the rest still
    # start in one pass of `burst_tokens`, not `prefill_chunk` tokens a step
    sched, step = make(SchedulerConfig(max_running=17, prefill_chunk=400,
                                       step_token_budget=2048, burst_tokens=800))
    sched.add(make_seq(0, 30, max_new=50))
    run_step(sched, step)
    for i in range(1, 17):
        sched.add(make_seq(i, 100))
    starts = []
    for _ in range(3):
        plan, _ = run_step(sched, step)
        assert all((c.start, c.end) == (0, 100) for c in plan.prefills)
        starts.append([c.seq.seq_id for c in plan.prefills])
    assert starts == [list(range(1, 9)), list(range(9, 17)), []]


# -- throttled prefill with prompts queued ---------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timed_step(sched, step, clock, decode_s, chunk_s):
    """One step that takes decode_s(rows) plus chunk_s(tokens) for its prefill, if any, on
    the fake clock; the plan."""
    plan = sched.schedule()
    tokens = sum(c.end - c.start for c in plan.prefills)
    elapsed = (decode_s(len(plan.decode)) if plan.decode else 0.0) + \
        (chunk_s(tokens) if tokens else 0.0)
    clock.now += elapsed
    sched.observe(plan, elapsed)
    sched.update(plan, step.run(plan))
    return plan


def decode_cost(rows: int) -> float:
    return 0.004 + 0.002 * rows


def chunk_cost(tokens: int) -> float:
    return 0.003 + 0.00005 * tokens


def test_prompts_queued_behind_a_throttle_are_read_as_fast_as_their_share_allows():
    # A stream decodes alone (its steps measured at one row), then twelve 1,500-token
    # prompts arrive. With the throttle sized by that one-row step and nothing else, every
    # chunk was the 16-token minimum: the one-row time was never measured again while prompts
    # queued, and a 16-token chunk's fixed cost made its tokens look dear. The last prompt
    # started 39 s later.
    clock = FakeClock()
    step = FakeModelStep()
    sched = Scheduler(SchedulerConfig(), token_pool(), step.admit, {EOS}, clock=clock)
    sched.add(make_seq(0, 30, max_new=100_000))
    for _ in range(8):
        timed_step(sched, step, clock, decode_cost, chunk_cost)
    prompts = [make_seq(i, 1500, max_new=100_000) for i in range(1, 13)]
    for seq in prompts:
        sched.add(seq)
    start, sizes = clock.now, []
    while not all(seq.output_tokens for seq in prompts):
        plan = timed_step(sched, step, clock, decode_cost, chunk_cost)
        sizes += [c.end - c.start for c in plan.prefills]
        assert clock.now - start < 60, "the prompts never started"
    assert clock.now - start < 3.0, f"the last prompt started {clock.now - start:.1f} s later"
    assert max(sizes) >= 256


def test_with_few_prompts_queued_the_throttle_holds_a_chunk_to_its_stall_allowance():
    # Eight streams and one long prompt (issue 7's stall case), then a second behind it (the
    # `long` scenario's two): stall_factor of a decode step of eight rows; a third adds as
    # much again.
    clock = FakeClock()
    step = FakeModelStep()
    config = SchedulerConfig()
    sched = Scheduler(config, token_pool(), step.admit, {EOS}, clock=clock)
    allowed = config.stall_factor * decode_cost(8)
    for i in range(8):
        sched.add(make_seq(i, 30, max_new=100_000))
    for _ in range(8):
        timed_step(sched, step, clock, decode_cost, chunk_cost)
    sched.add(make_seq(98, 2000, max_new=10, ctx=4096))
    assert sched.stall_allowance_s == allowed
    sched.add(make_seq(99, 2000, max_new=10, ctx=4096))
    assert sched.stall_allowance_s == allowed
    sched.add(make_seq(100, 2000, max_new=10, ctx=4096))
    assert sched.stall_allowance_s == 2 * allowed
    allowances, extras = [], []
    for _ in range(40):
        allowance = sched.stall_allowance_s
        plan = timed_step(sched, step, clock, decode_cost, chunk_cost)
        if plan.prefills:
            allowances.append(allowance)
            extras.append(chunk_cost(sum(c.end - c.start for c in plan.prefills)))
    assert allowances[0] == 2 * allowed and allowances[-1] == allowed
    # the cost model learns a chunk's fixed part as it goes (a per-token average before it
    # has chunks of different sizes, which makes a chunk after a change of rows up to 30%
    # dearer than it thought)
    assert all(extra <= 1.3 * a for extra, a in zip(extras, allowances)), \
        [(round(e * 1000, 2), round(a * 1000, 2)) for e, a in zip(extras, allowances)]


def test_a_throttled_step_decodes_alone_to_time_a_row_count_not_measured_lately():
    clock = FakeClock()
    step = FakeModelStep()
    config = SchedulerConfig()
    sched = Scheduler(config, token_pool(), step.admit, {EOS}, clock=clock)
    sched.add(make_seq(0, 30, max_new=100_000))
    for _ in range(4):
        timed_step(sched, step, clock, decode_cost, chunk_cost)
    sched.add(make_seq(1, 30, max_new=100_000))
    timed_step(sched, step, clock, decode_cost, chunk_cost)  # joins, unthrottled: 2 rows now
    sched.add(make_seq(2, 5000, max_new=10))
    plan = timed_step(sched, step, clock, decode_cost, chunk_cost)
    assert len(plan.decode) == 2 and plan.prefills == [], "two rows never timed: a probe"
    assert sched.timer.decode_for(2) is not None and sched.timer.decode_age_s(2) == 0
    plans = [timed_step(sched, step, clock, decode_cost, chunk_cost) for _ in range(20)]
    assert all(p.prefills for p in plans), "measured just now: no probe for a while"
    clock.now += config.probe_after_s
    assert timed_step(sched, step, clock, decode_cost, chunk_cost).prefills == []


def test_aligned_chunks_end_at_multiples_of_the_alignment_but_never_past_the_prompt():
    sched, step = make(SchedulerConfig(prefill_chunk=256, min_prefill_chunk=256,
                                       chunk_align=256), cached={1: 300})
    seq = make_seq(1, 1000, ctx=4000)
    sched.add(seq)
    ends = []
    while seq.status != SeqStatus.RUNNING:
        plan, _ = run_step(sched, step)
        ends += [(c.start, c.end) for c in plan.prefills]
    # after a 300-token cached prefix: up to 512 (a shorter chunk), then 256 at a time, and
    # the last chunk where the prompt ends
    assert ends == [(300, 512), (512, 768), (768, 1000)]


def test_an_allowance_that_reaches_no_multiple_keeps_its_length():
    sched, step = make(SchedulerConfig(prefill_chunk=100, min_prefill_chunk=100,
                                       chunk_align=256))
    seq = make_seq(1, 1000, ctx=4000)
    sched.add(seq)
    plan, _ = run_step(sched, step)
    assert (plan.prefills[0].start, plan.prefills[0].end) == (0, 100)
    plan, _ = run_step(sched, step)
    assert (plan.prefills[0].start, plan.prefills[0].end) == (100, 200)
    plan, _ = run_step(sched, step)  # 300 would pass 256: it stops there
    assert (plan.prefills[0].start, plan.prefills[0].end) == (200, 256)


def test_a_gpu_reads_at_least_its_chunk_aligned_and_a_cpu_keeps_the_defaults():
    from mlxr.runner.loader import GPU_CHUNK, scheduler_config
    from mlxr.shared.config import RunnerConfig

    config = RunnerConfig(model_dir="m", num_parallel=8, prefill_chunk=128)
    cpu, gpu = scheduler_config(config, on_gpu=False), scheduler_config(config, on_gpu=True)
    assert (cpu.min_prefill_chunk, cpu.chunk_align, cpu.prefill_chunk) == (16, 0, 128)
    assert (gpu.min_prefill_chunk, gpu.chunk_align, gpu.prefill_chunk) == \
        (GPU_CHUNK, GPU_CHUNK, GPU_CHUNK)
    assert cpu.max_running == gpu.max_running == 8
