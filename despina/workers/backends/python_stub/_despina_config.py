"""pb_utils' model configuration: ModelConfig for `auto_complete_config`, the config helpers, and
Triton's model loading API, which Despina refuses with its reason.

Part of `triton_python_backend_utils`, which re-exports these names; a model imports them from there.
"""
from __future__ import annotations

import json
from typing import Any, NoReturn

from _despina_errors import TritonModelException


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", ()) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", ()) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def load_model(model_name: str, config: str = "", files: Any = None) -> None:
    _no_model_loading("load_model")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _no_model_loading("unload_model")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    _no_model_loading("is_model_ready")


def _no_model_loading(function: str) -> NoReturn:
    """Triton's model loading API (load_model, unload_model, is_model_ready) is not Despina's: a model
    that uses it fails with this reason rather than an AttributeError."""
    raise TritonModelException(f"pb_utils.{function}: Despina does not let a Python model load, unload or "
                               "check models; load the models it calls through the repository API or "
                               "--load-model")


class ModelConfig:
    """The configuration handed to `auto_complete_config`; what it returns is the model's config. Its
    refusals say what Triton's pb_utils says, word for word."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        config.setdefault("input", [])
        config.setdefault("output", [])
        config.setdefault("max_batch_size", 0)
        self._model_config = config

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {current}, but in auto-complete-config "
                             f"function for model '{self._name()}' specified max_batch_size {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but auto-complete-"
                                 f"config function for model '{self._name()}' tries to set scheduling_choice "
                                 "as 'dynamic_batching'")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        if set(transaction_policy_dict) - {"decoupled"}:
            raise ValueError("model transaction property in auto-complete-config function for model "
                             f"'{self._name()}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            if "decoupled" in policy and policy["decoupled"] != transaction_policy_dict["decoupled"]:
                raise ValueError("trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name()}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = transaction_policy_dict["decoupled"]

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        where = f"in auto-complete-config function for model '{self._name()}'"
        if set(tensor) - set(allowed):
            listed = ", ".join(f"'{p}'" for p in allowed[:-1]) + f" and '{allowed[-1]}'"
            raise ValueError(f"{kind} '{tensor.get('name')}' {where} contains property other than {listed}.")
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                named = f"{kind} '{tensor['name']}'" if "name" in tensor else kind
                raise ValueError(f"{named} {where} is missing '{required}' property.")
        about = f"model '{self._name()}', tensor '{tensor['name']}': the model expects"
        for current in self._model_config[kind]:
            if current["name"] != tensor["name"]:
                continue
            declared = current.get("data_type", "TYPE_INVALID")
            if declared not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(f"unable to load model '{self._name()}', configuration expects datatype "
                                 f"{declared} for {kind} '{tensor['name']}', model provides "
                                 f"{tensor['data_type']}")
            dims = [int(d) for d in current.get("dims", [])]
            if dims and dims != [int(d) for d in tensor["dims"]]:
                raise ValueError(f"{about} dims {tensor['dims']} but the model configuration specifies dims "
                                 f"{current['dims']}")
            # (the config Triton hands over prints every field: an input of config.pbtxt says false)
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"{about} optional {tensor['optional']} but the model configuration "
                                 f"specifies optional {current['optional']}")
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))
