"""Counting a batch's items (tokens its labels do not ignore), the padded language-model batches, and the weights
by items of one synchronisation window."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynamix import LabelTokens
from lightning_dynamix.batch_core import PerRankBatchCore
from lightning_dynamix.data.language import IGNORE_INDEX, SyntheticTokenSequences, pad_sequences
from lightning_dynamix.distributed import SyncWindowWeighting


def test_label_tokens_counts_what_a_causal_model_s_loss_averages_over():
    labels = torch.tensor([[5, 6, 7, IGNORE_INDEX], [1, 2, IGNORE_INDEX, IGNORE_INDEX]])
    assert LabelTokens()({"labels": labels}) == 2 + 1  # the first position of each row predicts nothing
    assert LabelTokens(shift=False)({"labels": labels}) == 3 + 2
    assert LabelTokens(key=1, ignore_index=7, shift=False)((None, labels)) == 7


def test_label_tokens_equals_the_count_in_hugging_face_s_loss():
    transformers = pytest.importorskip("transformers", reason="the `transformers` extra (make setup installs it)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    batch = pad_sequences([SyntheticTokenSequences(4, vocab_size=16, seed=1)[i] for i in range(4)])
    count = LabelTokens()(batch)
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    mean = model(**kwargs).loss
    summed = model(**kwargs, num_items_in_batch=1).loss  # the sum over the tokens, divided by the count given
    assert (summed.detach() / count).item() == pytest.approx(mean.item(), rel=1e-12)


@pytest.mark.parametrize(
    ("key", "batch", "message"),
    [("labels", {"input_ids": torch.ones(2, 3)}, "found no labels in a batch of type dict"),
     ("labels", {"labels": torch.ones(2, 3)}, "integer tensor, got Tensor of torch.float32"),
     (2, (torch.ones(1), torch.ones(1)), "found no labels")],
)  # fmt: skip
def test_label_tokens_names_what_is_missing(key, batch, message):
    with pytest.raises(ValueError, match=message):
        LabelTokens(key=key)(batch)


def test_bad_counters_are_refused_at_construction_naming_the_argument():
    with pytest.raises(ValueError, match=r"`key` must be a str .* got 1.5"):
        LabelTokens(key=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`count_items` must be a callable .* got 'tokens'"):
        PerRankBatchCore("HeterogeneousDDPStrategy", [2, 2], count_items="tokens")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("count", "message"),
    [(lambda batch: 0, "counted 0 items in a batch of 2 samples"), (lambda batch: 2.5, "as an int >= 0, got 2.5")],
)
def test_a_count_of_zero_or_not_an_int_is_refused_when_the_batch_is_handed_out(count, message):
    data = SyntheticTokenSequences(8, min_length=2, max_length=2)
    core = PerRankBatchCore("DynamixAccelerate", [2, 2], count_items=LabelTokens(), world_size=2)
    loader = core.training_loader(DataLoader(data, batch_size=2, collate_fn=pad_sequences), 0, 2, "")
    next(iter(loader))
    assert loader.current_items == 2  # one token of each two-token sample is predicted
    loader.count_items = count
    with pytest.raises(ValueError, match=message):
        next(iter(loader))


def test_padding_is_hidden_from_attention_and_loss():
    data = SyntheticTokenSequences(3, vocab_size=8, min_length=2, max_length=6, seed=2)
    batch = pad_sequences([data[i] for i in range(3)])
    lengths = data.lengths.tolist()
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    assert (batch["labels"] == IGNORE_INDEX).sum().item() == 3 * max(lengths) - sum(lengths)
    assert batch["index"].tolist() == [0, 1, 2]
    assert data[1]["input_ids"].tolist() == SyntheticTokenSequences(3, vocab_size=8, min_length=2, max_length=6,
                                                                      seed=2)[1]["input_ids"].tolist()  # fmt: skip


def test_weights_by_items_make_the_window_the_mean_over_its_items():
    # rank 0 of 2; steps 0 and 1 in one window, estimated from step 0 alone, corrected at the synchronisation
    weighting = SyncWindowWeighting(rank=0)
    first = weighting.add_backward(0, [2, 3], loss_scale=0.5, window_estimate=20, items=[8, 12])
    second = weighting.add_backward(1, [1, 4], loss_scale=0.5, items=[5, 30])
    assert (first, second) == (8 / (0.5 * 20), 5 / (0.5 * 20))
    assert weighting.window_items == 55
    assert weighting.window_own_items == 13
    assert weighting.window_samples == 10
    assert weighting.sync_weight() == pytest.approx(20 / 55)  # the gradients then carry own items / all items
    with pytest.raises(ValueError, match="`items` must give every rank's count"):
        weighting.add_backward(2, [1, 1], items=[3])


def test_the_layer_offload_strategy_refuses_weights_by_items():
    from lightning_dynamix import HeterogeneousLayerOffloadStrategy

    with pytest.raises(ValueError, match="`count_items` is not supported by HeterogeneousLayerOffloadStrategy"):
        HeterogeneousLayerOffloadStrategy(count_items=LabelTokens(), num_embedding_servers=1)


def test_weighted_by_items_the_gradient_norms_are_the_items_means_counted_in_samples():
    # the noise scale stays in samples, the unit of the batch sizes it is compared with
    from lightning_dynamix.distributed import BucketNorms, WeightedAllReduceState, report_gradient_norms

    weighting = SyncWindowWeighting(rank=0)
    weighting.add_backward(0, [2, 3], items=[10, 30])
    state = WeightedAllReduceState()
    state.norms = BucketNorms([torch.tensor(1.0)], [torch.tensor(9.0)])  # the bucket held 10/40 of rank 0's mean
    reported = []
    report_gradient_norms(state, weighting, lambda *values: reported.append(values))
    ((local, own, reduced, total),) = reported
    assert (own, total) == (2, 5)
    assert local.item() == pytest.approx(16.0)  # (40 / 10)^2: rank 0's own mean gradient's squared norm
    assert reduced.item() == pytest.approx(9.0)
