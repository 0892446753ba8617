"""A stand-in for the parts of TensorRT-LLM 1.2 that a KV-cache connector touches.

NOT TensorRT-LLM. The engine cannot be installed on this project's machines (its PyPI
package fetches the real wheel from another index), so kvconn's adapter is tested
against this package, written from the connector API's documented signatures
(``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` and the LLM API's
``kv_connector_config``). It has never been compared with the real engine.
"""
