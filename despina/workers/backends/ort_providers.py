"""Which onnxruntime execution providers an instance gets, as Triton's onnxruntime backend chooses them.

In order of priority: on a GPU instance the config's `optimization { execution_accelerators {
gpu_execution_accelerator } }` in the order given ("tensorrt"; "cuda", whose parameters tune the CUDA
provider), then CUDA itself; on any instance `cpu_execution_accelerator` ("openvino"); last the CPU
provider. A GPU accelerator on a CPU instance is not consulted, as in Triton. Triton's parameter names are
taken and turned into onnxruntime's provider options; a name Triton does not know, a value it would refuse,
or a provider this onnxruntime lacks is the model's load error, so a config that asks for TensorRT never
runs without it unnoticed.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...contract.errors import ConfigError
from ...contract.modelconfig import parameter_bool, parameter_int, string_parameters

TENSORRT, CUDA, OPENVINO, CPU = ("TensorrtExecutionProvider", "CUDAExecutionProvider",
                                 "OpenVINOExecutionProvider", "CPUExecutionProvider")
INSTALL = {TENSORRT: "onnxruntime-gpu and TensorRT", CUDA: "onnxruntime-gpu",
           OPENVINO: "onnxruntime-openvino"}

# Triton's TensorRT accelerator parameters: the provider option each sets, and the kind of its value
_TRT_BOOL = ("int8_use_native_calibration_table", "trt_dla_enable", "trt_engine_cache_enable",
             "trt_dump_subgraphs", "trt_force_sequential_engine_build", "trt_context_memory_sharing_enable",
             "trt_layer_norm_fp32_fallback", "trt_timing_cache_enable", "trt_force_timing_cache",
             "trt_detailed_build_log", "trt_build_heuristics_enable", "trt_sparsity_enable",
             "trt_cuda_graph_enable", "trt_dump_ep_context_model")
_TRT_INT = ("max_workspace_size_bytes", "trt_max_partition_iterations", "trt_min_subgraph_size",
            "trt_dla_core", "trt_builder_optimization_level", "trt_auxiliary_streams",
            "trt_ep_context_embed_mode")
_TRT_STR = ("int8_calibration_table_name", "trt_engine_cache_path", "trt_engine_cache_prefix",
            "trt_timing_cache_path", "trt_tactic_sources", "trt_extra_plugin_lib_paths",
            "trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes",
            "trt_ep_context_file_path")
_TRT_OPTION = {"max_workspace_size_bytes": "trt_max_workspace_size",
               "int8_calibration_table_name": "trt_int8_calibration_table_name",
               "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table"}
_CUDA_BOOL = ("do_copy_in_default_stream", "use_ep_level_unified_stream", "use_tf32")
# The CUDA provider runs float32 matrix products and convolutions in TF32 (a 10-bit mantissa) unless its
# use_tf32 option (onnxruntime 1.18 on) says no: on an H200 that put 94 % of W2's answers outside
# rtol 1e-3 of the CPU's. Despina asks for float32's own precision, as PyTorch does for matrix products,
# so that a model answers alike on either device; the "cuda" accelerator's use_tf32 "1" takes the speed.
FULL_FP32 = {"use_tf32": "0"}
# the model-level parameters Triton still reads for the CUDA provider, and their values' names
_CUDNN_SEARCH = {"0": "EXHAUSTIVE", "1": "HEURISTIC", "2": "DEFAULT"}
_ARENA_STRATEGY = {"0": "kNextPowerOfTwo", "1": "kSameAsRequested"}

Provider = tuple[str, dict[str, str]]


def providers(model: str, config: dict[str, Any], kind: str, device: int,
              available: Sequence[str], tf32_option: bool = True) -> list[Provider]:
    """The providers, with their options, for an instance of `kind` ("CPU" or "GPU") on `device`, from
    the config as a dict (the protobuf's field names); `available` is onnxruntime's
    get_available_providers(), `tf32_option` whether its CUDA provider has use_tf32 (FULL_FP32)."""
    accelerators = ((config.get("optimization") or {}).get("execution_accelerators") or {})
    chosen: list[Provider] = []
    if kind == "GPU":
        cuda = {"device_id": str(device), **(FULL_FP32 if tf32_option else {}), **_legacy_cuda(model, config)}
        for accelerator in accelerators.get("gpu_execution_accelerator") or []:
            name, params = accelerator.get("name", ""), accelerator.get("parameters") or {}
            if name == "tensorrt":
                chosen.append((TENSORRT, {**_tensorrt(model, params), "device_id": str(device)}))
            elif name == "cuda":
                cuda.update(_cuda(model, params))
            else:
                raise _unknown(model, name)
        chosen.append((CUDA, cuda))
    for accelerator in accelerators.get("cpu_execution_accelerator") or []:
        name, params = accelerator.get("name", ""), accelerator.get("parameters") or {}
        if name != "openvino":
            raise _unknown(model, name)
        chosen.append((OPENVINO, {"device_type": "CPU", **params}))
    for provider, _ in chosen:
        if provider not in available:
            raise ConfigError(
                f"model '{model}': {provider} is asked for (optimization.execution_accelerators or a GPU "
                f"instance) but this onnxruntime has only {', '.join(available)}; install "
                f"{INSTALL[provider]}")
    return [*chosen, (CPU, {})]


def _tensorrt(model: str, params: dict[str, str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for key, value in params.items():
        option = _TRT_OPTION.get(key, key)
        if key == "precision_mode":
            if value == "FP16":
                options["trt_fp16_enable"] = "True"
            elif value == "INT8":
                options["trt_int8_enable"] = "True"
            elif value != "FP32":
                raise ConfigError(f"model '{model}': unsupported precision mode '{value}' is requested "
                                  "(FP32, FP16 or INT8)")
        elif key in _TRT_BOOL:
            options[option] = "True" if parameter_bool(model, key, value) else "False"
        elif key in _TRT_INT:
            options[option] = str(parameter_int(model, key, value))
        elif key in _TRT_STR:
            options[option] = value
        else:
            raise ConfigError(f"model '{model}': unknown parameter '{key}' is provided for TensorRT "
                              "Execution Accelerator")
    return options


def _cuda(model: str, params: dict[str, str]) -> dict[str, str]:
    """The "cuda" accelerator's parameters are the CUDA provider's own options, booleans checked here and
    the rest by onnxruntime when the session starts."""
    return {key: (("1" if parameter_bool(model, key, value) else "0") if key in _CUDA_BOOL else value)
            for key, value in params.items() if value}


def _legacy_cuda(model: str, config: dict[str, Any]) -> dict[str, str]:
    """cudnn_conv_algo_search, gpu_mem_limit, arena_extend_strategy and do_copy_in_default_stream from
    the model's parameters, which Triton still honours (the "cuda" accelerator's win over them)."""
    params = string_parameters(config)
    options: dict[str, str] = {}
    for key, names in (("cudnn_conv_algo_search", _CUDNN_SEARCH), ("arena_extend_strategy", _ARENA_STRATEGY)):
        if key in params:
            if params[key] not in names:
                raise ConfigError(f"model '{model}': unsupported {key} value '{params[key]}' is requested "
                                  f"({', '.join(f'{n} {v}' for n, v in names.items())})")
            options[key] = names[params[key]]
    if "gpu_mem_limit" in params:
        options["gpu_mem_limit"] = str(parameter_int(model, "gpu_mem_limit", params["gpu_mem_limit"]))
    key = "do_copy_in_default_stream"
    if key in params:
        options[key] = "1" if parameter_bool(model, key, params[key]) else "0"
    return options


def _unknown(model: str, name: str) -> ConfigError:
    return ConfigError(f"model '{model}': unknown Execution Accelerator '{name}' is requested (onnxruntime "
                       "takes tensorrt and cuda on GPU instances, openvino on the CPU)")
