"""Softmax and arg-max over the MLP's logits, written for Triton's Python backend (serves unchanged there).

Requests come in batches: each request's rows are computed in one numpy call.
"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probabilities = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
            label = logits.argmax(axis=1).astype(np.int64).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("probabilities", probabilities), pb_utils.Tensor("label", label)]))
        return responses
