"""Triton's ensembles: a model whose `ensemble_scheduling` chains other models' steps into a graph.

Each step calls one model; its `input_map` names, for each of that model's inputs, the ensemble
tensor that feeds it, and its `output_map` names the ensemble tensor each of its outputs becomes. A
step runs once every tensor it reads exists; steps that do not depend on each other run at once.

Two sets of checks, as Triton makes them at load: `Ensemble.from_config` checks the graph alone
(every tensor made once and used, nothing read that nothing makes, no cycle, every output made), and
`problems` checks it against the models it calls (they exist and are usable, their tensors have
the names, types and shapes the ensemble wires together, no ensemble calls itself).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .ensemble_stream import problem
from .errors import ConfigError
from .modelspec import ModelSpec, TensorSpec

PLATFORM = "ensemble"


def is_ensemble(config: dict[str, Any]) -> bool:
    return config.get("platform") == PLATFORM or config.get("backend") == PLATFORM


def called_by(config: dict[str, Any]) -> set[str]:
    """The models a config's ensemble steps call (none for a model that is not an ensemble)."""
    return {step.get("model_name", "") for step in (config.get("ensemble_scheduling") or {}).get("step", ())}


@dataclass(frozen=True, slots=True)
class Step:
    index: int                           # 0-based, in the config's order
    model: str
    version: int | None                  # None: the model's latest serving version (-1 in the config)
    inputs: tuple[tuple[str, str], ...]  # (the model's input, the ensemble tensor that feeds it)
    outputs: tuple[tuple[str, str], ...]  # (the model's output, the ensemble tensor it becomes)
    asked: tuple[str, ...] = field(init=False)  # the model's outputs it asks for (made once: per request)

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", tuple(o for o, _ in self.outputs))

    def __str__(self) -> str:
        return f"step {self.index + 1} (model '{self.model}')"


@dataclass(frozen=True, slots=True)
class Ensemble:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]     # the ensemble's own inputs and outputs
    outputs: tuple[str, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Ensemble:
        """The ensemble in a config (Triton's JSON form); ConfigError when its graph cannot run."""
        name = config.get("name", "")
        scheduling = config.get("ensemble_scheduling") or {}
        raw_steps = scheduling.get("step") or []
        if not raw_steps:
            raise ConfigError(f"model '{name}': an ensemble needs field 'ensemble_scheduling' with at least "
                              "one step")
        steps = []
        for i, raw in enumerate(raw_steps):
            model = raw.get("model_name") or ""
            where = f"model '{name}': ensemble step {i + 1}"
            if not model:
                raise ConfigError(f"{where} has no field 'model_name'")
            version = int(raw.get("model_version", -1))
            if version < -1:  # (0 is version 0, as in Triton: -1 alone is the latest)
                raise ConfigError(f"{where}: field 'model_version' must be -1 (latest) or a version, "
                                  f"got {version}")
            inputs = tuple((raw.get("input_map") or {}).items())
            outputs = tuple((raw.get("output_map") or {}).items())
            if not inputs:
                raise ConfigError(f"{where} (model '{model}') has an empty 'input_map': it would read "
                                  "nothing")
            if not outputs:
                raise ConfigError(f"{where} (model '{model}') has an empty 'output_map': it would make "
                                  "nothing")
            steps.append(Step(i, model, None if version == -1 else version, inputs, outputs))
        ensemble = cls(name, tuple(steps), tuple(t["name"] for t in config.get("input", [])),
                       tuple(t["name"] for t in config.get("output", [])))
        ensemble._check_graph()
        return ensemble

    def _check_graph(self) -> None:
        made: dict[str, str] = {t: "the ensemble's inputs" for t in self.inputs}
        for step in self.steps:
            for _, tensor in step.outputs:
                if tensor in made:
                    raise ConfigError(f"model '{self.name}': ensemble tensor '{tensor}' is made by both "
                                      f"{made[tensor]} and {step}; each tensor must be made once")
                made[tensor] = str(step)
        for step in self.steps:
            for model_input, tensor in step.inputs:
                if tensor not in made:
                    raise ConfigError(f"model '{self.name}': {step} reads ensemble tensor '{tensor}' (into "
                                      f"its input '{model_input}'), which no input and no step makes")
        for tensor in self.outputs:
            if tensor not in made:
                raise ConfigError(f"model '{self.name}': ensemble output '{tensor}' is made by no step")
        read = {t for s in self.steps for _, t in s.inputs}
        unused = [t for t in self.inputs if t not in read]
        if unused:
            raise ConfigError(f"model '{self.name}': ensemble input(s) {', '.join(unused)} feed no step")
        for tensor, maker in made.items():
            if tensor not in read and tensor not in self.outputs:
                raise ConfigError(f"model '{self.name}': ensemble tensor '{tensor}' from {maker} is unused: "
                                  "no step reads it and it is no ensemble output")
        self.order()  # raises on a cycle

    def order(self) -> list[list[Step]]:
        """The steps in waves: each wave needs only the ensemble's inputs and the waves before it."""
        have = set(self.inputs)
        left = list(self.steps)
        waves: list[list[Step]] = []
        while left:
            wave = [s for s in left if all(t in have for _, t in s.inputs)]
            if not wave:
                names = ", ".join(str(s) for s in left)
                raise ConfigError(f"model '{self.name}': ensemble steps {names} wait on each other (a cycle)")
            waves.append(wave)
            have.update(t for s in wave for _, t in s.outputs)
            left = [s for s in left if s not in wave]
        return waves

    def needed_for(self, outputs: tuple[str, ...]) -> list[Step]:
        """The steps that `outputs` need, in the config's order. As Triton prunes an ensemble for a request
        that asks for some of its outputs, the others do not run; asked for all, every step runs."""
        if set(outputs) >= set(self.outputs):
            return list(self.steps)
        makers = {tensor: s for s in self.steps for _, tensor in s.outputs}
        needed: set[int] = set()
        todo = [makers[t] for t in outputs if t in makers]
        while todo:
            step = todo.pop()
            if step.index not in needed:
                needed.add(step.index)
                todo.extend(makers[t] for _, t in step.inputs if t in makers)
        return [s for s in self.steps if s.index in needed]

    def problems(self, own: ModelSpec, lookup: Callable[[str], tuple[ModelSpec | None, str]]) -> str:
        """Why the ensemble cannot serve with the models it calls ('' when it can). `lookup(name)`
        gives a model's spec, or None and why it is not usable."""
        tensors: dict[str, tuple[TensorSpec, bool, str]] = {}  # tensor -> (its spec, batched, who makes it)
        for t in own.inputs:
            tensors[t.name] = (t, own.batched, "the ensemble's input")
        specs: dict[int, ModelSpec] = {}
        decoupled: list[Step] = []
        for step in self.steps:
            spec, why = lookup(step.model)
            if spec is None:
                return f"{step}: {why}"
            if is_ensemble(spec.config) and self._reaches(step.model, lookup):
                return f"{step}: the ensembles call each other in a cycle"
            if spec.decoupled:
                decoupled.append(step)
            # a model that does not batch may take a batching ensemble's tensors whole, as in Triton,
            # when its dims hold the batch dimension (the shapes, checked below, agree)
            if own.batched and spec.batched and spec.max_batch_size < own.max_batch_size:
                return (f"{step}: its max_batch_size {spec.max_batch_size} is below the ensemble's "
                        f"{own.max_batch_size}")
            specs[step.index] = spec
            for model_output, tensor in step.outputs:
                out = spec.output(model_output)
                if out is None:
                    return f"{step}: the model has no output '{model_output}' (output_map)"
                tensors[tensor] = (out, spec.batched, str(step))
        for step in self.steps:
            spec = specs[step.index]
            mapped = {i for i, _ in step.inputs}
            for model_input, tensor in step.inputs:
                want = spec.input(model_input)
                if want is None:
                    return f"{step}: the model has no input '{model_input}' (input_map)"
                got, batched, maker = tensors[tensor]
                if got.datatype != want.datatype:
                    return (f"{step}: input '{model_input}' is {want.datatype} but ensemble tensor "
                            f"'{tensor}' from {maker} is {got.datatype}")
                if not _dims_fit(_full(got, batched), _full(want, spec.batched)):
                    return (f"{step}: input '{model_input}' has shape {list(_full(want, spec.batched))} but "
                            f"ensemble tensor '{tensor}' from {maker} has {list(_full(got, batched))}")
            missing = [t.name for t in spec.inputs if not t.optional and t.name not in mapped]
            if missing:
                return f"{step}: the model's input(s) {', '.join(missing)} are fed by nothing (input_map)"
        for t in own.outputs:
            got, batched, maker = tensors[t.name]
            if got.datatype != t.datatype:
                return f"ensemble output '{t.name}' is {t.datatype} but {maker} makes {got.datatype}"
            if not _dims_fit(_full(got, batched), _full(t, own.batched)):
                return (f"ensemble output '{t.name}' has shape {list(_full(t, own.batched))} but {maker} "
                        f"makes {list(_full(got, batched))}")
        if decoupled and own.response_cache:  # Triton refuses it, as a decoupled model's (modelconfig.py)
            return (f"{decoupled[0]}: the model is decoupled, and so the ensemble (one request, several "
                    "responses): the response cache does not support it; remove response_cache or its "
                    "enable: true")
        if decoupled:
            return problem(self, decoupled)
        return ""

    def cycle(self, lookup: Callable[[str], tuple[ModelSpec | None, str]]) -> str:
        """Why the ensemble cannot serve because it calls itself through the ensembles its steps call (''
        when it does not). `lookup` should give the spec of every model in the catalog, usable or not:
        judged through the usable ones only, a cycle hides behind the failure it causes its members."""
        for step in self.steps:
            spec, _ = lookup(step.model)
            if spec is not None and is_ensemble(spec.config) and self._reaches(step.model, lookup):
                return f"{step}: the ensembles call each other in a cycle"
        return ""

    def _reaches(self, start: str, lookup: Callable[[str], tuple[ModelSpec | None, str]]) -> bool:
        """Whether the ensemble `start`, or an ensemble it calls, calls this one."""
        seen: set[str] = set()
        todo = [start]
        while todo:
            name = todo.pop()
            if name == self.name:
                return True
            if name in seen:
                continue
            seen.add(name)
            spec, _ = lookup(name)
            if spec is not None:
                todo.extend(called_by(spec.config))
        return False


def _full(t: TensorSpec, batched: bool) -> tuple[int, ...]:
    return (-1, *t.dims) if batched else t.dims


def _dims_fit(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))
