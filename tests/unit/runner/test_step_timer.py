"""The prefill cost model (runner/step_timer.py): no mlx, hand-made step times."""

from mlxr.runner.step_timer import StepTimer


def cost(n: int, start: int) -> float:
    """9 ms a chunk, 0.26 ms a token, and 0.26 us per token per position attended over."""
    return 0.009 + 0.00026 * n + 0.00000026 * n * (start + n / 2)


def test_a_chunk_deep_in_a_long_prompt_is_sized_for_the_context_it_attends_over():
    # What a long prompt read beside decoding streams looks like: large chunks early, small
    # ones as the context grows. Fitted on size alone, the small late chunks look like a
    # large fixed cost and the large early ones like a small slope, so a budget just above
    # the fixed part bought a chunk many times too long.
    timer = StepTimer()
    timer.observe(8, 0, 0.024)  # a decode step
    for n, start in ((256, 0), (200, 256), (150, 456), (64, 2000), (32, 4000), (16, 6000),
                     (16, 6016), (16, 6032)):
        timer.observe(8, n, 0.024 + cost(n, start), context=start)
    budget = 0.75 * 0.024
    at_7000 = timer.chunk_for(budget, context=7000)
    assert at_7000 is not None and cost(at_7000, 7000) <= budget * 1.05
    assert cost(at_7000 + 8, 7000) > budget  # and not far below it either
    at_100 = timer.chunk_for(budget, context=100)
    assert at_100 > 2 * at_7000  # early in the prompt, tokens are cheaper


def test_without_a_spread_of_positions_the_fit_is_on_size_alone():
    timer = StepTimer()
    timer.observe(8, 0, 0.024)
    for n in (16, 32, 64, 16, 32, 64):
        timer.observe(8, n, 0.024 + 0.009 + 0.00026 * n, context=100)
    assert timer.context_token_s == 0.0
    assert abs(timer.prefill_fixed_s - 0.009) < 1e-9 and abs(timer.prefill_token_s - 0.00026) < 1e-9
    assert timer.chunk_for(0.018) == 34


def test_a_slow_decode_step_does_not_move_the_decode_estimate():
    # A moving average caught at one slow step let every chunk of a long prompt add that
    # much more to its step; the median of the recent steps does not move.
    timer = StepTimer()
    for elapsed in (0.020, 0.021, 0.019, 0.020, 0.070, 0.020, 0.011):
        timer.observe(8, 0, elapsed)
    assert timer.decode_for(8) == 0.020
    for elapsed in (0.060, 0.060, 0.060, 0.060, 0.060, 0.060, 0.060, 0.060):
        timer.observe(8, 0, elapsed)
    assert timer.decode_for(8) == 0.060  # a lasting change is followed


def decode_steps(timer, rows: int, *times: float) -> None:
    for elapsed in times:
        timer.observe(rows, 0, elapsed)


def test_a_decode_step_is_timed_per_number_of_rows_and_read_off_the_others_between():
    timer = StepTimer()
    assert timer.decode_for(4) is None
    decode_steps(timer, 2, 0.010, 0.010, 0.010)
    decode_steps(timer, 8, 0.022, 0.022, 0.022)
    assert timer.decode_for(2) == 0.010 and timer.decode_for(8) == 0.022
    assert abs(timer.decode_for(5) - 0.016) < 1e-12  # between the two
    assert abs(timer.decode_for(12) - 0.030) < 1e-12  # 2 ms a row further on
    assert abs(timer.decode_for(1) - 0.008) < 1e-12


def test_one_step_of_a_row_count_does_not_set_its_time_alone():
    # A probe taken while the machine was busy would set every chunk's budget for seconds.
    timer = StepTimer()
    decode_steps(timer, 2, 0.010, 0.010, 0.010)
    decode_steps(timer, 8, 0.022, 0.022, 0.022)
    decode_steps(timer, 5, 0.060)
    assert abs(timer.decode_for(5) - 0.016) < 1e-12
    decode_steps(timer, 5, 0.018)
    assert timer.decode_for(5) == 0.018
    decode_steps(timer, 5, 0.019)
    assert timer.decode_for(5) == 0.019  # three steps of its own: their median


def test_more_rows_are_never_read_off_as_faster():
    timer = StepTimer()
    decode_steps(timer, 2, 0.020, 0.020, 0.020)
    decode_steps(timer, 4, 0.010, 0.010, 0.010)  # noise, or longer contexts at 2 rows
    assert timer.decode_for(3) == 0.020
    assert timer.decode_for(6) == 0.010


def test_the_age_of_a_row_counts_measurement():
    now = [100.0]
    timer = StepTimer(clock=lambda: now[0])
    assert timer.decode_age_s(3) == float("inf")
    decode_steps(timer, 3, 0.020)
    now[0] += 2.5
    assert timer.decode_age_s(3) == 2.5
    timer.observe(3, 16, 0.030)  # a step with a chunk measures no decode step
    assert timer.decode_age_s(3) == 2.5
