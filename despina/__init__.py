"""Despina: a serverless function platform for machine-learning models."""
import os

__version__ = "0.1.0"

# onnxruntime 1.29 and later send telemetry from Linux too (a device id under ~/.cache/Microsoft, an
# upload to mobile.events.data.microsoft.com a few seconds apart, from every process that loads it: the
# worker, the control plane reading a model's inputs, a Python model's stub). A server does not phone
# home unasked: Despina opts out before anything loads onnxruntime, in this process and the ones it
# starts. Setting either variable yourself (ORT_DISABLE_TELEMETRY=0) leaves the choice to you.
TELEMETRY_OPT_OUT = ("ORT_DISABLE_TELEMETRY", "ORT_TELEMETRY_DISABLED")  # 1.29-1.32's name, then later
if not any(name in os.environ for name in TELEMETRY_OPT_OUT):
    os.environ.update(dict.fromkeys(TELEMETRY_OPT_OUT, "1"))
