"""A Hugging Face causal language model (padded sequences of 4-39 tokens, a loss that is the mean over the tokens
its labels do not ignore) trains with uneven, changing per-rank sizes exactly as one process on the global
batches, under ``DynamixAccelerate`` and ``HeterogeneousDDPStrategy``, when the gradients are weighted by tokens
(``count_items=LabelTokens()``); weighted by samples, it does not."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import import_job

pytest.importorskip("transformers", reason="the `transformers` extra (make setup installs it)")

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 48
# (first sizes, decisions: (after batch, sizes)); the issue's [6, 2] -> [3, 7] -> [8, 1], and ranks sitting out
SEQUENCES = {
    2: ([6, 2], [(1, [3, 7]), (3, [8, 1])]),
    3: ([2, 5, 0], [(1, [0, 6, 4]), (3, [3, 0, 7]), (5, [4, 4, 4])]),
}


def _worst(job, results, num_samples, accumulate):
    expected = job.one_process([r["steps"] for r in results], num_samples, accumulate)
    return max((result["params"][k] - expected[k]).abs().max().item() for result in results for k in expected)


def _every_sample_once(results, epochs):
    for epoch in range(epochs):
        seen = sorted(i for r in results for (e, _, indices) in r["steps"] if e == epoch for i in indices)
        assert seen == list(range(NUM_SAMPLES)), f"epoch {epoch} did not train every sample exactly once"


@pytest.mark.parametrize(
    ("front_end", "world_size", "accumulate"),
    [("accelerate", 2, 1), ("accelerate", 3, 2), ("lightning", 2, 1), ("lightning", 3, 1), ("lightning", 3, 2)],
)
def test_weighted_by_tokens_trains_like_one_process_on_the_global_batches(pools, front_end, world_size, accumulate):
    job = import_job("causal_lm")
    first, plan = SEQUENCES[world_size]
    epochs = 2
    results = pools(world_size).run(
        "causal_lm", front_end, first=first, plan=plan, accumulate=accumulate, by_tokens=True,
        num_samples=NUM_SAMPLES, epochs=epochs, seed=1,
    )  # fmt: skip
    _every_sample_once(results, epochs)
    assert _worst(job, results, NUM_SAMPLES, accumulate) <= 1e-6


@pytest.mark.parametrize("front_end", ["accelerate", "lightning"])
def test_weighted_by_samples_a_token_mean_loss_is_not_the_global_batch_s(pools, front_end):
    # the control: today's weighting by samples differs from one process, so the test above can fail
    job = import_job("causal_lm")
    first, plan = SEQUENCES[2]
    results = pools(2).run(
        "causal_lm", front_end, first=first, plan=plan, accumulate=1, by_tokens=False, num_samples=NUM_SAMPLES,
        epochs=1, seed=1,
    )  # fmt: skip
    assert _worst(job, results, NUM_SAMPLES, 1) > 1e-4


def test_every_rank_s_token_positions_and_padding_are_measured_and_gathered(pools):
    # what balance by tokens reads: each rank's work per step (positions, padding included) and its padding
    results = pools(2).run("causal_lm", "measured", sizes=[3, 5], num_samples=NUM_SAMPLES)
    states = results[0]["states"]
    assert states
    assert all(result["states"] == states for result in results)  # gathered: the same on every rank
    for rank, result in enumerate(results):
        positions = [p for p, _ in result["positions"]]
        padding = sum(pad for _, pad in result["positions"]) / sum(positions)
        for state in states:
            size, work, pad = state[rank]
            assert size == [3, 5][rank]
            assert min(positions) <= work <= max(positions)  # a mean over the interval's steps
            assert 0 < pad < 1
        assert padding == pytest.approx(sum(s[rank][2] for s in states) / len(states), abs=0.15)
    job_padding = [sum(s[r][1] * s[r][2] for r in range(2)) / sum(s[r][1] for r in range(2)) for s in states]
    assert results[0]["logged"] == pytest.approx(job_padding)  # dynamix/padding, the job's, for the loggers


def test_a_loss_logged_with_sync_dist_is_the_global_batch_s_token_mean(pools):
    # self.log("train_loss", loss, sync_dist=True) in training_step: the ranks' token means weighted by their tokens
    job = import_job("causal_lm")
    first, plan = SEQUENCES[2]
    results = pools(2).run("causal_lm", "logged_losses", first=first, plan=plan, by_tokens=True, num_samples=24)
    expected = job.one_process_losses([r["steps"] for r in results], 24)
    for result in results:
        assert result["logged"] == pytest.approx(expected, rel=1e-6)  # float32: the loss, and logged values
    # weighted by samples (no count_items), it is the mean of the ranks' token means by samples: not the global one
    by_samples = pools(2).run("causal_lm", "logged_losses", first=first, plan=plan, by_tokens=False, num_samples=24)
    assert abs(by_samples[0]["logged"][0] - expected[0]) > 1e-4


def test_dynamix_accelerate_s_global_mean_is_the_global_batch_s_token_mean_also_where_a_rank_sits_out(pools):
    job = import_job("causal_lm")
    first, plan = SEQUENCES[3]
    results = pools(3).run(
        "causal_lm", "accelerate", first=first, plan=plan, accumulate=1, by_tokens=True, num_samples=NUM_SAMPLES,
        epochs=1, seed=1,
    )  # fmt: skip
    expected = job.one_process_losses([r["steps"] for r in results], NUM_SAMPLES)
    for result in results:
        assert result["logged"] == pytest.approx(expected, rel=1e-6)  # transformers computes the loss in float32
