import os

# CPU unless this machine has an NVIDIA GPU (then `pytest -m gpu` runs the native GPU tests).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines compile in the background only the buckets their steps ask for: idle engines held
# by fixtures would otherwise compile every other bucket beside the next tests (the tests of
# background compilation itself turn it back on).
os.environ.setdefault("JAXINFER_BACKGROUND_COMPILE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    # Tests marked slow run with JAXINFER_SLOW_TESTS=1 (or `-m slow`); CI runs the rest, a
    # representative subset that fits its time.
    if os.environ.get("JAXINFER_SLOW_TESTS") != "1" and "slow" not in (config.option.markexpr
                                                                        or ""):
        skip_slow = pytest.mark.skip(reason="slow: set JAXINFER_SLOW_TESTS=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    from jaxinfer.checkpoints.default_model import ensure_default_model

    return ensure_default_model()
