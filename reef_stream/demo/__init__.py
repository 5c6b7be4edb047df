"""The demo: a toy task learned from reward alone, and the serving replicas ``reef demo`` runs.

``reef_stream.demo.task``: the vocabulary, the prompts, the tiny transformer policy, sampling,
the exact-match reward and the held-out-accuracy candidate evaluator (pure, no Kafka).
``reef_stream.demo.replica``: a serving replica that samples from the current promoted version
and sends its generations through the producer SDK (``python -m reef_stream.demo.replica``).
``reef demo --engine vllm``: ``vllm_model`` (the tiny Qwen2-style Hugging Face policy and its
tokenizer, built once), ``vllm_recipes`` (the example methods bound to it), ``vllm_serving``
(the vLLM server the demo starts and stops) and ``vllm_replica`` (the one process that drives
the server's reloads and samples it).
"""
