import os

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses the real smollm2-135m bundle (seconds to minutes); still runs in CI")
    config.addinivalue_line("markers", "browser: drives Debian chromium through playwright")


@pytest.fixture(scope="session")
def toy():
    from d3d_core.bundles import get_bundle

    return get_bundle("toy")


@pytest.fixture(scope="session")
def toy_qwen3():
    from d3d_core.bundles import get_bundle

    return get_bundle("toy-qwen3")


@pytest.fixture(scope="session")
def smollm():
    from d3d_core.bundles import get_bundle

    return get_bundle("smollm2-135m")
