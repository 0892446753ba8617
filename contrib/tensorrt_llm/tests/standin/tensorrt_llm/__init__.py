"""A stand-in for the parts of TensorRT-LLM 1.2 that a KV-cache connector touches.

NOT TensorRT-LLM. The engine cannot be installed on this project's machines (its PyPI
package fetches the real wheel from another index), so kvconn's adapter is tested
against this package. Its connector interface and the engine-side manager that drives
it were checked against TensorRT-LLM's own source (``kv_cache_connector.py``,
``resource_manager.py``, ``py_executor.py``, ``kvCacheManager.cpp``); the commit, and
every difference found and corrected, are listed in docs/engines/tensorrt-llm.md.
"""
