"""Streams its input back a word at a time, from a thread, as a decoupled model does: execute only
starts the work and returns None; each request's response sender carries the words, the last one flagged
final. The delay between words is the config's word_delay_ms (or the request's parameter of that name)."""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.delay_ms = float(config["parameters"]["word_delay_ms"]["string_value"])

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            delay_ms = float(json.loads(request.parameters()).get("word_delay_ms", self.delay_ms))
            words = text.decode("utf-8", "replace").split() or [""]
            sender = request.get_response_sender()
            threading.Thread(target=self.stream, args=(words, delay_ms / 1000, sender), daemon=True).start()
        return None

    def stream(self, words, delay_s, sender):
        for i, word in enumerate(words):
            if i:
                time.sleep(delay_s)
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", np.array([word.encode()], dtype=np.object_)),
                pb_utils.Tensor("index", np.array([i], dtype=np.int32))])
            last = i == len(words) - 1
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
