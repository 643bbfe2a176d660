"""pdserve.batch.pipeline: pipeline parallelism for throughput: the decoder's layers over N stage
processes, and the schedules that keep them busy (TD-Pipe, seed 001; issue 15). A second engine
built from the engine's parts (model, KV cache, block manager, sampler); of pdserve it imports
only ``pdserve.engine``.

Reading path:
  ``config.py``     PipelineConfig: stages, schedule, KV blocks, batch sizes (no torch)
  ``engine.py``     PipelineEngine: the controller (requests in the engine's one Scheduler, the one
                    BlockManager, outputs); spawns the stages, keeps up to N micro-batches in flight
  ``schedules.py``  what the next micro-batch is: ``mixed`` (hybrid batching) or ``td-pipe``; the
                    prompts in it (queue order, token budget, chunks, blocks) are the Scheduler's
  ``switch.py``     TD-Pipe's decisions as pure logic: memory simulation (prefill -> decode),
                    intensity comparison (decode -> prefill), work stealing
  ``stage.py``      one stage process: its layers, its layers' paged KV, the loop
  ``protocol.py``   the messages (header + one packed payload per hop) over torch.distributed
  ``meta.py``       a model's config and tokenizer without its weights (for the controller)
  ``cli.py``        ``pdserve batch``: an OpenAI batch JSONL file through the pipeline
                    (``pdserve batch-server``, ``batch/serve.py`` and ``batch/pipeline_service.py``:
                    the Batch API whose jobs run here, one line per sequence, via ``eng.step()``)

::

    from pdserve.batch.pipeline.engine import PipelineConfig, PipelineEngine
    with PipelineEngine("tiny", PipelineConfig(num_stages=2, schedule="td-pipe")) as eng:
        eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=64, temperature=0))
        outputs = eng.run()      # {request id: RequestOutput}; the same greedy tokens as LLMEngine
        # or, adding requests as they come: while eng.has_work(): finished = eng.step()

Stages use gloo on CPU (one torch thread each by default) and NCCL on CUDA (stage s on
cuda:s; written, not tested on this CPU-only project machine).
"""
