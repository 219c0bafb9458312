"""What a PyTorch model may return, as Triton's libtorch path says (src/model_instance_state.cc, Execute and
ReadOutputTensors): a Tensor, a List[str], or a tuple of those. Anything else fails each request with
Triton's words and code: INTERNAL (500) for what forward() gave, INVALID_ARG (400) for an output the
config names that the model lacks, gives in another datatype, or gives as a scalar. Models are built here with torch.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from despina.contract.errors import BackendError, Code, DespinaError

from .conftest import Server, module_server
from .test_pytorch_parameters import load_backend

torch = pytest.importorskip("torch")

CONFIG = '''
platform: "pytorch_libtorch"
max_batch_size: 4
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {outputs} ]
'''
FP32_OUT = '{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2 ] }'


class AsDict(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"OUTPUT__0": x}


class AsTensorList(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, x + 1]


class WithTensorList(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return x, [x]


class WithDict(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x, {"y": x}


class AsNumber(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return x.shape[0]


class AsScalar(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


class Steps(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + 1, x + 2, x + 3


class AsLong(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.long()


def build(repo: Path, name: str, module: torch.nn.Module, outputs: str = FP32_OUT) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\n' + CONFIG.format(outputs=outputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(module).save(str(folder / "1" / "model.pt"))
    return folder


X = {"INPUT__0": np.ones((1, 2), dtype=np.float32)}
REFUSED = "output must be of type Tensor, List[str] or Tuple containing one of these two types. It should " \
          "not be a List / Dictionary of Tensors or a Scalar"


@pytest.mark.parametrize(("module", "words"), [
    (AsDict(), REFUSED),
    (AsNumber(), REFUSED),
    (AsTensorList(), "output must be of type Tensor or List[str], received List[Tensor]"),
    (WithTensorList(), "output at index 1 must be of type Tensor or List[str], received List[Tensor]"),
    (WithDict(), "output at index 1 must be of type Tensor or List[str], received Dict[str, Tensor]"),
], ids=["dict", "number", "tensor_list", "tuple_with_tensor_list", "tuple_with_dict"])
def test_a_result_triton_refuses_fails_each_request_with_its_words(tmp_path: Path, module: torch.nn.Module,
                                                                  words: str) -> None:
    """The model loads (Triton checks at execution) and each call fails: Triton's INTERNAL, a 500."""
    backend = load_backend(build(tmp_path, "refused", module))
    for _ in range(2):
        with pytest.raises(BackendError, match=re.escape(f"model 'refused': PyTorch execute failure: {words}")):
            backend.execute(X, ["OUTPUT__0"])
    backend.unload()


def test_an_output_index_the_model_lacks_is_an_invalid_argument(tmp_path: Path) -> None:
    """As in Triton: an index past what the model returns fails the request (INVALID_ARG), not the load;
    the outputs the config lists may be any of the model's."""
    some = load_backend(build(tmp_path, "some", Steps(), '{ name: "OUTPUT__2", data_type: TYPE_FP32, dims: [ 2 ] }, '
                                                          '{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2 ] }'))
    out = some.execute(X, ["OUTPUT__2", "OUTPUT__0"])
    assert out["OUTPUT__2"].tolist() == [[4.0, 4.0]] and out["OUTPUT__0"].tolist() == [[2.0, 2.0]]
    some.unload()
    beyond = load_backend(build(tmp_path, "beyond", Steps(), FP32_OUT.replace("__0", "__3")))
    with pytest.raises(DespinaError, match="model 'beyond': the output OUTPUT__3 in the model configuration "
                                           "refers to an output index which doesn't exist. This model has 3 "
                                           "outputs") as caught:
        beyond.execute(X, ["OUTPUT__3"])
    assert caught.value.code == Code.INVALID_ARGUMENT
    beyond.unload()


def test_an_output_of_another_datatype_than_the_config_says_is_an_invalid_argument(tmp_path: Path) -> None:
    """As in Triton (INVALID_ARG): never an answer under a datatype the model's metadata does not give."""
    backend = load_backend(build(tmp_path, "as_long", AsLong()))
    with pytest.raises(DespinaError, match="configuration expects datatype TYPE_FP32 for output 'OUTPUT__0', "
                                           "model provides TYPE_INT64") as caught:
        backend.execute(X, ["OUTPUT__0"])
    assert caught.value.code == Code.INVALID_ARGUMENT
    backend.unload()


def test_a_scalar_output_is_an_invalid_argument(tmp_path: Path) -> None:
    """As in Triton's ReadOutputTensors (INVALID_ARG): a 0-dimension tensor is no output of the config's
    shape, batched or not."""
    backend = load_backend(build(tmp_path, "as_scalar", AsScalar()))
    with pytest.raises(DespinaError, match="model 'as_scalar': output 'OUTPUT__0' is a scalar which is not "
                                           "supported.") as caught:
        backend.execute(X, ["OUTPUT__0"])
    assert caught.value.code == Code.INVALID_ARGUMENT
    backend.unload()


# -- the statuses a client sees -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("torch-outputs")
    build(repo, "as_dict", AsDict())
    build(repo, "beyond", Steps(), FP32_OUT.replace("__0", "__3"))
    build(repo, "as_long", AsLong())
    build(repo, "as_scalar", AsScalar())
    yield from module_server(repo, tmp_path_factory, redis_url, ("as_dict", "beyond", "as_long", "as_scalar"))


@pytest.mark.parametrize(("model", "status", "words"), [
    ("as_dict", 500, "PyTorch execute failure: output must be of type Tensor, List[str] or Tuple"),
    ("beyond", 400, "the output OUTPUT__3 in the model configuration refers to an output index which doesn't "
                    "exist. This model has 3 outputs"),
    ("as_long", 400, "configuration expects datatype TYPE_FP32 for output 'OUTPUT__0', model provides "
                     "TYPE_INT64"),
    ("as_scalar", 400, "output 'OUTPUT__0' is a scalar which is not supported."),
])
def test_the_client_hears_tritons_status_and_words(server: Server, model: str, status: int, words: str) -> None:
    body = {"inputs": [{"name": "INPUT__0", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
