"""The config fields Despina does not act on. What Triton itself refuses outside TensorRT models, and what
names a part Despina lacks (a backend runtime, a repository agent), is refused at load with the reason;
the others load, and `ignored` names them for one warning per model, so that nothing that would change
a model's results or resources in Triton is dropped without a word."""
from __future__ import annotations

from typing import Any

from ._schema import model_config_pb2 as pb
from .errors import ConfigError

_IMAGE_FORMATS = (pb.ModelInput.FORMAT_NHWC, pb.ModelInput.FORMAT_NCHW)


def refuse(config: Any) -> None:
    """Triton's load errors for TensorRT-only fields, and fields that name what Despina has not."""
    model = config.name
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for t in tensors:
            if t.is_shape_tensor:
                raise ConfigError(f"model '{model}': {kind} '{t.name}': field 'is_shape_tensor': shape "
                                  "tensors are only supported for TensorRT models (Despina serves none)")
    for t in config.input:
        if t.format in _IMAGE_FORMATS and len(t.dims) != 3:
            raise ConfigError(f"model '{model}': input '{t.name}': field 'format' "
                              f"{pb.ModelInput.Format.Name(t.format)} needs 3 dims (C, H, W or H, W, C), got "
                              f"{list(t.dims)}")
    for index, group in enumerate(config.instance_group):
        if group.profile:
            raise ConfigError(f"model '{model}': instance_group[{index}]: field 'profile' is only supported "
                              "for TensorRT models")
        if group.kind == pb.ModelInstanceGroup.KIND_MODEL and group.gpus:
            raise ConfigError(f"model '{model}': instance group {group.name or f'{model}_{index}'} has kind "
                              "KIND_MODEL but specifies one or more GPUs")
    if config.instance_group and all(g.passive for g in config.instance_group):
        raise ConfigError(f"model '{model}': every instance group is passive: no instance would take "
                          "requests (field 'instance_group.passive')")
    utilization = config.sequence_batching.direct.minimum_slot_utilization
    if not 0 <= utilization <= 1:
        raise ConfigError(f"model '{model}': field 'sequence_batching.direct.minimum_slot_utilization' must "
                          f"be in range [0, 1], got {utilization:g}")
    if config.runtime and config.runtime != f"libtriton_{config.backend}.so":
        raise ConfigError(f"model '{model}': field 'runtime' '{config.runtime}': Despina runs backend "
                          f"'{config.backend}' its own way (leave 'runtime' out, or give "
                          f"'libtriton_{config.backend}.so')")
    for agent in config.model_repository_agents.agents:
        if agent.name != "checksum":
            raise ConfigError(f"model '{model}': field 'model_repository_agents': repository agent "
                              f"'{agent.name}' is not supported by Despina (it would change or check the "
                              "model's files before load; Despina has Triton's 'checksum' agent only)")
        for key in agent.parameters:
            algorithm, colon, _ = key.partition(":")
            if not colon:
                raise ConfigError(f"model '{model}': checksum agent: failed to parse key: {key} (give "
                                  "'MD5:<file in the model's folder>')")
            if algorithm.lower() != "md5":
                raise ConfigError(f"model '{model}': checksum agent: unsupported checksum algorithm: "
                                  f"{algorithm} (Triton's agent has MD5 only)")


def ignored(config: Any, rate_limited: bool = False) -> list[str]:
    """The fields set in `config` (a validated ModelConfig) that Despina ignores, each with why; a field
    present with nothing in it (as a config sent back from GET .../config may have) is no setting.
    `rate_limited`: the rate limiter is on (--rate-limit), which heeds rate_limiter."""
    found = []
    for index, group in enumerate(config.instance_group):
        where = f"instance_group[{index}]"
        if not rate_limited and (group.rate_limiter.resources or group.rate_limiter.priority):
            found.append(f"{where}.rate_limiter (the rate limiter is off, as Triton's without --rate-limit)")
        if group.host_policy:
            found.append(f"{where}.host_policy (Despina has no host policies)")
        if group.secondary_devices:
            found.append(f"{where}.secondary_devices (TensorRT's)")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        found += [f"{kind} '{t.name}'.is_non_linear_format_io (TensorRT's)" for t in tensors
                  if t.is_non_linear_format_io]
    opt = config.optimization
    if opt.priority != pb.ModelOptimizationPolicy.PRIORITY_DEFAULT:
        found.append("optimization.priority")
    cuda = opt.cuda
    if cuda.graphs or cuda.busy_wait_events or cuda.graph_spec or cuda.output_copy_stream:
        found.append("optimization.cuda (CUDA graphs and streams)")
    if opt.gather_kernel_buffer_threshold:
        found.append("optimization.gather_kernel_buffer_threshold")
    if opt.eager_batching:
        found.append("optimization.eager_batching")
    sequence = config.sequence_batching
    if sequence.oldest.preserve_ordering:
        found.append("sequence_batching.oldest.preserve_ordering (each sequence's replies keep their order; "
                     "different sequences' may pass each other)")
    if config.ensemble_scheduling.max_inflight_requests:
        found.append("ensemble_scheduling.max_inflight_requests (an ensemble's requests are not limited)")
    if config.cc_model_filenames:
        found.append("cc_model_filenames (default_model_filename is loaded on every device)")
    if config.model_operations.op_library_filename and config.backend != "onnxruntime":
        found.append(f"model_operations (backend '{config.backend}' loads no custom operation library)")
    if config.model_metrics.metric_control:
        found.append("model_metrics")
    return found
