"""Row sharding, routing and the servers' sparse optimisers: the arithmetic the offload strategy relies on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynamix.offload import RowAdagrad, RowSGD, RowSharding, make_sparse_optimizer, route
from lightning_dynamix.offload.sharding import route_tables


@pytest.mark.parametrize(("rows", "shards"), [(10, 1), (10, 3), (7, 4), (3, 5)])
def test_every_row_lives_on_exactly_one_server_and_a_table_splits_and_joins_back(rows, shards):
    sharding = RowSharding(rows, shards)
    ids = torch.arange(rows)
    shard, local = sharding.locate(ids)
    assert sum(sharding.shard_rows(s) for s in range(shards)) == rows
    for s in range(shards):
        assert torch.equal(sharding.global_ids(s, local[shard == s]), ids[shard == s])
        assert int((shard == s).sum()) == sharding.shard_rows(s)
    table = torch.randn(rows, 4)
    parts = sharding.split(table)
    assert torch.equal(sharding.join(parts), table)


def test_a_checkpointed_table_reshards_into_another_number_of_servers():
    table = torch.randn(11, 3)
    two = RowSharding(11, 2).split(table)
    three = RowSharding(11, 3).split(RowSharding(11, 2).join(two))
    assert torch.equal(RowSharding(11, 3).join(three), table)
    with pytest.raises(ValueError, match="got 2 shards for a sharding over 3"):
        RowSharding(11, 3).join(two)


def test_a_batch_fetches_each_distinct_row_once_and_sums_the_gradients_of_duplicates():
    sharding = RowSharding(20, 3)
    table = torch.randn(20, 2)
    shards = sharding.split(table)
    ids = torch.tensor([[4, 7, 4], [19, 0, 7]])
    plan = route(ids, sharding)
    assert plan.unique.tolist() == [0, 4, 7, 19]
    assert sum(len(r) for r in plan.shard_rows) == 4  # each distinct id once
    fetched = plan.assemble([shards[s][plan.shard_rows[s]] for s in range(3)])
    assert torch.equal(fetched[plan.inverse].reshape(2, 3, 2), table[ids])
    rows = fetched.clone().requires_grad_()
    rows[plan.inverse].sum().backward()  # every id of the batch contributes a gradient of ones
    per_shard = plan.split(rows.grad)
    assert [len(g) for g in per_shard] == [len(r) for r in plan.shard_rows]
    assert plan.assemble(per_shard)[:, 0].tolist() == [1.0, 2.0, 2.0, 1.0]  # ids 4 and 7 appear twice


def test_an_id_outside_the_table_is_refused_naming_the_table_and_the_id():
    with pytest.raises(ValueError, match=r"embedding 'C7': id 20 is outside \[0, 20\)"):
        route(torch.tensor([3, 20]), RowSharding(20, 2), table="C7")
    with pytest.raises(ValueError, match=r"embedding 'C7': id -1 is outside"):
        route(torch.tensor([-1, 3]), RowSharding(20, 2), table="C7")
    shardings = {"C1": RowSharding(5, 2), "C7": RowSharding(20, 2)}
    with pytest.raises(ValueError, match=r"embedding 'C7': id 20 is outside \[0, 20\)"):
        route_tables({"C1": torch.tensor([4]), "C7": torch.tensor([3, 20])}, shardings)
    with pytest.raises(ValueError, match=r"embedding 'C1': id 5 is outside \[0, 5\)"):
        route_tables({"C1": torch.tensor([5]), "C7": torch.tensor([3])}, shardings)


@pytest.mark.parametrize("shards", [1, 3])
def test_tables_routed_together_fetch_and_push_what_each_routed_alone_does(shards):
    # a step's lookup of every table at once (one request per server): the same rows, the same gradients
    generator = torch.Generator().manual_seed(0)
    sizes = {"a": 7, "b": 1, "c": 50, "d": 4}
    tables = {name: torch.randn(rows, 3, generator=generator) for name, rows in sizes.items()}
    shardings = {name: RowSharding(rows, shards) for name, rows in sizes.items()}
    shards_of = {name: shardings[name].split(table) for name, table in tables.items()}
    ids = {name: torch.randint(0, rows, (4, 5), generator=generator) for name, rows in sizes.items()}
    ids["d"] = torch.empty((0,), dtype=torch.int64)  # a table this batch does not touch
    together = route_tables(ids, shardings)
    answers = [
        {name: shards_of[name][server][rows] for name, rows in together.shard_rows[server].items()}
        for server in range(shards)
    ]
    fetched = together.assemble(answers, 3)
    grads = {}
    for index, (name, rows) in enumerate(zip(together.tables, fetched)):
        alone = route(ids[name], shardings[name])
        own = together.table(index)
        assert torch.equal(own.unique, alone.unique)
        assert torch.equal(own.inverse, alone.inverse)
        assert torch.equal(rows[own.inverse].reshape(*ids[name].shape, 3), tables[name][ids[name]])
        for server in range(shards):  # each server is asked for exactly the rows it holds of the batch
            asked = together.shard_rows[server].get(name, torch.empty(0, dtype=torch.int64))
            assert torch.equal(asked, alone.shard_rows[server])
        grads[name] = torch.randn(rows.shape, generator=generator)
    pushed = together.split(torch.cat([grads[name] for name in together.tables]), {"a", "c", "d"})
    for name in ("a", "c"):
        alone = route(ids[name], shardings[name])
        for server, expected in enumerate(alone.split(grads[name])):
            rows, values = pushed[server][name]  # every server, its rows or none: its optimiser counts the step
            assert torch.equal(rows, alone.shard_rows[server])
            assert torch.equal(values, expected)
    assert all(set(tables) == {"a", "c", "d"} for tables in pushed)  # b was not trained


@pytest.mark.parametrize(
    ("name", "kwargs", "reference"),
    [
        ("sgd", {"lr": 0.02}, lambda p: torch.optim.SGD(p, lr=0.02)),
        ("adagrad", {"lr": 0.3}, lambda p: torch.optim.Adagrad(p, lr=0.3)),
        (
            "adagrad",
            {"lr": 0.3, "lr_decay": 0.1, "initial_accumulator_value": 0.2, "eps": 1e-6},
            lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.1, initial_accumulator_value=0.2, eps=1e-6),
        ),
    ],
)
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_sharded_sparse_updates_match_torchs_optimizer_on_a_sparse_embedding(name, kwargs, reference, shards):
    torch.manual_seed(0)
    embedding = nn.Embedding(13, 4, sparse=True)
    sharding = RowSharding(13, shards)
    weights = sharding.split(embedding.weight.detach())
    optimizer = make_sparse_optimizer(name, **kwargs)
    states = [optimizer.init_state(w) for w in weights]
    torch_optimizer = reference(embedding.parameters())
    target = torch.randn(4)
    for _ in range(5):
        ids = torch.randint(0, 13, (6, 3))  # duplicates on purpose
        # one process
        torch_optimizer.zero_grad()
        (embedding(ids) @ target).pow(2).sum().backward()
        torch_optimizer.step()
        # sharded: fetch, backward on the fetched rows, send per-row gradients back
        plan = route(ids, sharding)
        rows = plan.assemble([weights[s][plan.shard_rows[s]] for s in range(shards)]).requires_grad_()
        (rows[plan.inverse].reshape(6, 3, 4) @ target).pow(2).sum().backward()
        for s, grads in enumerate(plan.split(rows.grad)):
            optimizer.step(weights[s], states[s], plan.shard_rows[s], grads)
    torch.testing.assert_close(sharding.join(weights), embedding.weight.detach(), rtol=0, atol=1e-6)


def test_unknown_sparse_optimizers_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"`sparse_optimizer` must be one of \['adagrad', 'sgd'\]"):
        make_sparse_optimizer("adamw")
    with pytest.raises(ValueError, match="bad arguments"):
        make_sparse_optimizer("sgd", momentum=0.9)
    with pytest.raises(ValueError, match="`lr` must be a finite number > 0"):
        RowSGD(lr=0)
    with pytest.raises(ValueError, match="`eps` must be a finite number >= 0"):
        RowAdagrad(eps=-1.0)
    with pytest.raises(ValueError, match="`num_shards` must be an int >= 1, got 0"):
        RowSharding(10, 0)


def _train(shards, sharding, ids_per_step, target):
    """Steps of the sharded table: fetch, backward on the fetched rows, every shard updated (maybe with no rows)."""
    for ids in ids_per_step:
        plan = route(ids, sharding)
        rows = plan.assemble([shards[s].lookup(plan.shard_rows[s]) for s in range(sharding.num_shards)])
        rows.requires_grad_()
        (rows[plan.inverse].reshape(*ids.shape, -1) @ target).pow(2).sum().backward()
        for s, grads in enumerate(plan.split(rows.grad)):
            shards[s].update(plan.shard_rows[s], grads)


def test_a_checkpoint_resumes_on_another_number_of_servers_and_training_continues_identically():
    from lightning_dynamix.offload import TableShard, reshard_states

    torch.manual_seed(0)
    embedding = nn.Embedding(17, 4, sparse=True)
    reference = torch.optim.Adagrad(embedding.parameters(), lr=0.3, lr_decay=0.05, initial_accumulator_value=0.1)
    target = torch.randn(4)
    steps = [torch.randint(0, 17, (5, 2)) for _ in range(6)]
    optimizer = make_sparse_optimizer("adagrad", lr=0.3, lr_decay=0.05, initial_accumulator_value=0.1)

    two = RowSharding(17, 2)
    shards = [TableShard("C1", two, s, w, optimizer) for s, w in enumerate(two.split(embedding.weight.detach()))]
    _train(shards, two, steps[:3], target)
    saved = [shard.state_dict() for shard in reversed(shards)]  # any order

    three = RowSharding(17, 3)
    states = reshard_states(saved, 3, optimizer.row_state_keys())
    resumed = [TableShard("C1", three, s, torch.zeros(three.shard_rows(s), 4), optimizer) for s in range(3)]
    for shard, state in zip(resumed, states):
        shard.load_state_dict(state)
    _train(resumed, three, steps[3:], target)

    for ids in steps:
        reference.zero_grad()
        (embedding(ids) @ target).pow(2).sum().backward()
        reference.step()
    torch.testing.assert_close(three.join([s.weight for s in resumed]), embedding.weight.detach(), rtol=0, atol=1e-6)


def test_shard_states_that_do_not_fit_are_refused():
    from lightning_dynamix.offload import TableShard, reshard_states

    optimizer = make_sparse_optimizer("sgd", lr=0.1)
    two = RowSharding(9, 2)
    shards = [TableShard("C2", two, s, w, optimizer) for s, w in enumerate(two.split(torch.randn(9, 3)))]
    with pytest.raises(ValueError, match=r"split over 2 shards; got the states of shards \[1\]"):
        reshard_states([shards[1].state_dict()], 3, ())
    with pytest.raises(ValueError, match="re-shard it first with reshard_states"):
        shards[0].load_state_dict(shards[1].state_dict())
    with pytest.raises(ValueError, match=r"`weight` must have 5 rows and 2 dimensions, got shape \(4, 3\)"):
        TableShard("C2", two, 0, torch.randn(4, 3), optimizer)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_table_s_rows_and_gradients_keep_its_dtype_also_where_a_server_holds_none_of_the_batch(dtype):
    sharding = RowSharding(10, 2)
    shards = sharding.split(torch.randn(10, 3).to(dtype))
    plan = route(torch.tensor([1, 7, 3, 7]), sharding)  # odd ids only: server 0 holds none of them
    assert not len(plan.shard_rows[0])
    answers = [shards[s][plan.shard_rows[s]] if len(plan.shard_rows[s]) else torch.empty((0, 3), dtype=dtype)
               for s in range(2)]  # fmt: skip
    rows = plan.assemble(answers)
    assert rows.dtype == dtype
    assert torch.equal(rows, shards[1][[0, 1, 3]])  # ids 1, 3 and 7
    assert all(grads.dtype == dtype for grads in plan.split(torch.ones_like(rows)))
    with pytest.raises(ValueError, match="answers for one table have different dtypes: "):
        plan.assemble([torch.empty((0, 3), dtype=torch.float32 if dtype != torch.float32 else torch.float64),
                       answers[1]])  # fmt: skip


def test_tables_of_one_row_length_and_different_dtypes_are_never_assembled_into_one_tensor():
    # a step's tables routed together share one tensor: only tables of one dtype may be
    shardings = {"f64": RowSharding(6, 2), "bf16": RowSharding(5, 2)}
    tables = {"f64": torch.randn(6, 2, dtype=torch.float64), "bf16": torch.randn(5, 2).bfloat16()}
    ids = {"f64": torch.tensor([0, 3, 5]), "bf16": torch.tensor([4, 1])}
    for name in tables:  # routed apart, each table keeps its dtype, its rows exact
        together = route_tables({name: ids[name]}, {name: shardings[name]})
        shards = shardings[name].split(tables[name])
        answers = [{name: shards[s][rows] for name, rows in together.shard_rows[s].items()} for s in range(2)]
        (rows,) = together.assemble(answers, 2, tables[name].dtype)
        assert rows.dtype == tables[name].dtype
        assert torch.equal(rows[together.table(0).inverse], tables[name][ids[name]])
        pushed = together.split(torch.ones_like(rows), {name})
        assert all(pushed[s][name][1].dtype == tables[name].dtype for s in range(2))
    # with no rows at all, the dtype given is the rows'
    empty = route_tables({"bf16": torch.empty(0, dtype=torch.int64)}, {"bf16": shardings["bf16"]})
    assert empty.assemble([{}, {}], 2, torch.bfloat16)[0].dtype == torch.bfloat16
    # routed together, the answers of the table of the other dtype are refused, naming it: never cast
    together = route_tables(ids, shardings)
    answers = [
        {name: shardings[name].split(tables[name])[s][rows] for name, rows in together.shard_rows[s].items()}
        for s in range(2)
    ]
    with pytest.raises(ValueError, match=r"embedding 'bf16': server \d answered bfloat16 rows, routed together"
                       r" with float64 ones"):  # fmt: skip
        together.assemble(answers, 2, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_shard_keeps_its_dtype_in_its_optimiser_state_and_in_a_checkpoint_resharded(dtype):
    from lightning_dynamix.offload import TableShard, reshard_states

    optimizer = make_sparse_optimizer("adagrad", lr=0.5)
    two = RowSharding(9, 2)
    shards = [TableShard("C3", two, s, w, optimizer) for s, w in enumerate(two.split(torch.randn(9, 3).to(dtype)))]
    for shard in shards:
        shard.update(torch.tensor([0, 2]), torch.ones(2, 3, dtype=dtype))
        assert shard.weight.dtype == shard.state["sum"].dtype == dtype
    states = reshard_states([shard.state_dict() for shard in shards], 3, optimizer.row_state_keys())
    assert all(state["weight"].dtype == state["state"]["sum"].dtype == dtype for state in states)
    three = RowSharding(9, 3)
    resumed = [TableShard("C3", three, s, torch.zeros(3, 3, dtype=dtype), optimizer) for s in range(3)]
    for shard, state in zip(resumed, states):
        shard.load_state_dict(state)
        assert shard.weight.dtype == shard.state["sum"].dtype == dtype
    assert torch.equal(three.join([s.weight for s in resumed]), two.join([s.weight for s in shards]))
    # a state saved in another dtype is cast into the shard's, its optimiser state with it, as torch's own
    # load_state_dict does for a parameter and its state
    other = torch.float64 if dtype != torch.float64 else torch.float32
    shard = TableShard("C3", three, 0, torch.zeros(3, 3, dtype=other), optimizer)
    shard.load_state_dict(states[0])
    assert shard.weight.dtype == shard.state["sum"].dtype == other
    assert shard.state["step"] == 1
