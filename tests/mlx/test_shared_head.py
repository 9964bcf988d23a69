"""A prompt whose last chunk is read beside decoding rows takes its logits from the same head
call as theirs (runner/model_step.py `_shared_head`): one pass over the head's weights in
that step, and every sequence's greedy tokens still mlx-lm's own."""

import pytest
from mlx_lm.utils import load

from mlxr.runner.kv import rows
from mlxr.runner.model_step import ModelStep
from mlxr.runner.request import Sequence
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.shared.protocol import Options
from mlxr.supervisor.store.random_model import write_random_model
from tests.mlx.test_host_attention import mlx_lm_greedy


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model, _ = load(str(write_random_model(tmp_path_factory.mktemp("m"), preset="tiny")))
    return model


def sequence(seq_id: int, prompt: list[int], steps: int) -> Sequence:
    seq = Sequence(seq_id, prompt, Options(temperature=0.0), max_new_tokens=steps,
                   context_length=4096)
    seq.sampler = Sampler.from_options(seq.options, seq.context_length)
    return seq


@pytest.mark.parametrize("host_attention", [True, False], ids=["numpy", "mlx"])
def test_a_prompt_ending_beside_decoding_rows_shares_their_head(model, host_attention):
    step = ModelStep(model, 0, lambda token: "", host_attention=host_attention)
    assert step.uses_rows
    scheduler = Scheduler(SchedulerConfig(prefill_chunk=64, min_prefill_chunk=64),
                          step.make_pool(512, 16), admit=step.admit, eos_token_ids=set())
    heads = []
    head = step._head
    step._head = lambda hidden: heads.append(hidden.shape[0]) or head(hidden)

    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(length)]
               for k, length in enumerate((20, 33, 300, 150))]
    seqs = [sequence(i, p, 12) for i, p in enumerate(prompts)]
    scheduler.add(seqs[0])
    scheduler.add(seqs[1])
    shared = []
    for number in range(200):
        if number == 3:  # two streams decode while the longer prompts are read in chunks
            scheduler.add(seqs[2])
            scheduler.add(seqs[3])
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        ended = sum(c.is_last for c in plan.prefills)  # before the step: it grows the prompts
        heads.clear()
        scheduler.update(plan, step.run(plan))
        if plan.decode and ended:
            shared.append(heads == [len(plan.decode) + ended])
    assert shared and all(shared)
    assert [s.output_tokens for s in seqs] == [mlx_lm_greedy(model, p, 12) for p in prompts]
