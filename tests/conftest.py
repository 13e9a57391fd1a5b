import pytest


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _trt_refusal():
    """Why TensorRT engines cannot execute here (None when they can): trt_gpu tests skip with it."""
    try:
        from dflash_trt.engines.load import EngineError, check_can_execute

        check_can_execute()
        return None
    except EngineError as e:
        return str(e)


def pytest_collection_modifyitems(config, items):
    trt = [item for item in items if "trt_gpu" in item.keywords]
    why = _trt_refusal() if trt else None
    for item in trt if why else []:
        item.add_marker(pytest.mark.skip(reason=why))
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread (two threads on a loaded 2-core runner were 20-30x slower). Modules opt
    in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
