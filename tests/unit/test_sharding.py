"""What the trainer's FSDP (``reef_stream.engine.sharding``) needs without a process group: the
option and its checks, the blocks a Hugging Face model is sharded by, the optimizer state keyed
by index (a checkpoint's, whatever the sharding) and by name (``set_state_dict``'s) and back,
and one process asked for FSDP training unsharded (there is nothing to shard across). Two
sharded ranks: tests/integration/test_trainer_fsdp.py, test_fsdp_checkpoint.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reef_stream.api.recipe import apply_overrides
from reef_stream.core.errors import ConfigurationError
from reef_stream.engine.hf import HuggingFace, Lora
from reef_stream.engine.sharding import (
    expected_pieces, optimizer_by_index, optimizer_by_name, parameter_names, sharding_of,
)
from reef_stream.engine.training import TorchBackend
from tests.recipes.trainable import recipe as trainable
from tests.unit_log import rollout_unit


def _recipe(model):
    return dataclasses.replace(trainable, backend=dataclasses.replace(trainable.backend,
                                                                      model=model))


def test_sharding_is_a_field_of_the_model_checked_and_set_like_any_other():
    assert HuggingFace("/models/base").sharding == "none"
    assert sharding_of(HuggingFace("/models/base", sharding="fsdp")) == "fsdp"
    assert sharding_of(lambda: None) == "none"   # a model without the option: DDP
    changed = apply_overrides(_recipe(HuggingFace("/models/base")),
                              ["backend.model.sharding=fsdp"])
    assert changed.backend.model == HuggingFace("/models/base", sharding="fsdp")
    with pytest.raises(ConfigurationError, match="HuggingFace.sharding must be 'none' .* or "
                                                 "'fsdp' .*, got 'zero3'"):
        HuggingFace("/models/base", sharding="zero3")


def test_a_hugging_face_model_is_sharded_by_its_decoder_layers(llama_dir):
    path = str(llama_dir)
    for model in (HuggingFace(path)(), HuggingFace(path, lora=Lora(rank=2))()):
        blocks = model.blocks()
        assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
        assert all(any(b is layer for layer in model.base.model.layers) for b in blocks)


def test_the_optimizer_state_goes_by_name_and_back_to_the_same_index_keyed_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW([{"params": [model[1].weight, model[0].bias]},
                                   {"params": [model[0].weight, model[1].bias], "lr": 0.1}])
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    names = parameter_names(model, optimizer)
    assert names == ["1.weight", "0.bias", "0.weight", "1.bias"]   # the optimizer's order
    by_name = optimizer_by_name(state, names)
    assert list(by_name["state"]) == names
    assert [g["params"] for g in by_name["param_groups"]] == [names[:2], names[2:]]
    assert by_name["param_groups"][1]["lr"] == 0.1
    assert by_name["state"]["0.weight"]["exp_avg"] is state["state"][2]["exp_avg"]
    back = optimizer_by_index(by_name, names)
    assert back["param_groups"] == state["param_groups"]
    assert list(back["state"]) == [0, 1, 2, 3]
    assert all(back["state"][i] == state["state"][i] for i in range(4))
    # A checkpoint's keys as read back (ints), as strings, or already names: the same.
    assert optimizer_by_name({"state": {"2": {}}, "param_groups": []}, names)["state"] == \
        {"0.weight": {}}
    assert optimizer_by_index(state, names)["state"].keys() == state["state"].keys()
    with pytest.raises(ConfigurationError, match="has parameter 4, but the optimizer holds 4"):
        optimizer_by_name({"state": {4: {}}, "param_groups": []}, names)
    with pytest.raises(ConfigurationError, match="names parameter 'head.weight'"):
        optimizer_by_index({"state": {"head.weight": {}}, "param_groups": []}, names)


def test_unsharded_tensors_are_expected_whole_and_the_names_must_match():
    weights = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.ones(2)}
    assert all(torch.equal(expected_pieces(weights, weights, rank, 2)[n], weights[n])
               for rank in (0, 1) for n in weights)
    with pytest.raises(ConfigurationError, match=r"name different tensors: \['b'\]"):
        expected_pieces(weights, {"a": weights["a"]}, 0, 2)


def test_one_process_asked_for_fsdp_trains_unsharded_with_the_same_checkpoint(llama_dir):
    sharded = TorchBackend(_recipe(HuggingFace(str(llama_dir), sharding="fsdp")))
    plain = TorchBackend(_recipe(HuggingFace(str(llama_dir))))
    assert sharded.sharded is None and sharded.held() is None
    units = [rollout_unit(i) for i in range(trainable.schedule.units_per_step)]
    for backend in (sharded, plain):
        backend.train_step(units, trainable.objective.compute(
            units, trainable.objective.initial_state()), 1)
    (weights, optimizer, _), (plain_weights, plain_optimizer, _) = sharded.state(), plain.state()
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)
    assert optimizer["param_groups"] == plain_optimizer["param_groups"]
    assert all(torch.equal(optimizer["state"][i]["exp_avg"], plain_optimizer["state"][i]["exp_avg"])
               for i in plain_optimizer["state"])


def test_reef_check_says_the_backend_is_sharded():
    from reef_stream.cli.check import contract_lines
    from reef_stream.core.serde import SchemaRegistry

    def backend_line(model):
        lines = contract_lines(_recipe(model), "r", SchemaRegistry.default())
        return next(line for line in lines if line.startswith("backend:"))

    assert backend_line(HuggingFace("/models/base", sharding="fsdp")).endswith(
        "; sharded with FSDP")
    assert "FSDP" not in backend_line(HuggingFace("/models/base"))
