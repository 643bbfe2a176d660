"""pdserve.batch: OpenAI's Batch API (/v1/files, /v1/batches), jobs in SQLite, and TD-Pipe's
pipeline-parallel engine that runs them for throughput.

Request lifecycle of a batch job:

1. **upload** - ``POST /v1/files`` (multipart, ``purpose=batch``): the file is refused whole
   only when it cannot be a batch input at all (``lines.check_upload``: too large, empty, not
   UTF-8, not JSONL), else stored as a BLOB (``store.py``); 400 naming the problem.
2. **create** - ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``):
   parameters checked (``lines.check_batch_params``), one row in ``validating``, the runner
   woken (``api.py``, ``BatchService``).
3. **pick lines** - the ``BatchRunner`` (``runner.py``, one asyncio task) splits the input
   into lines (each bad line becomes an error line at once) -> ``in_progress``, then starts
   pending lines, oldest batch first, while fewer than ``max_in_flight`` are in flight.
4. **run each line** - through ``run_line(url, body) -> (status, request id, body)``, one of:
   - the node (``pdserve prefill``: ``runner.execute``): a non-streamed request through the
     prefill's own ``Frontend``, with the admission queue, decode choice, deadline and metrics
     of an online request, in the batch SLO class; a 429/503 (no room yet) leaves the line
     pending to run again;
   - the TD-Pipe pipeline (``pdserve batch-server``: ``pipeline_service.PipelineExecutor``):
     one sequence of a ``PipelineEngine`` (``pipeline/``: the decoder's layers over stage
     processes, prefill and decode phases separated in time), many lines in it at once.
   The answer is recorded with the line's completion in one transaction, only if the line was
   still pending (``store.record``): each line finishes exactly once, and a line in flight
   when the process died is still pending after a restart and runs again.
5. **output file** - no pending line and none in flight -> ``finalizing``: the output file
   (2xx answers) and the error file (every other line) are written from the recorded lines
   -> ``completed`` (or ``expired`` past ``expires_at``; ``cancelling`` -> ``cancelled``);
   ``GET /v1/files/{id}/content`` downloads them.

Reading path (in this order):
  ``api.py``                BatchService: the routes and their start-up on a prefill (``pdserve prefill``
                            mounts them on its HTTP port; docs/batch.md)
  ``runner.py``             BatchRunner: a job's statuses, its lines in flight (bounded); ``execute``: a
                            line through the prefill's Frontend; StoreThread: the store on one thread
  ``store.py``              BatchStore: files, jobs and lines in SQLite; each line recorded exactly once
  ``lines.py``              the input checks: uploads, batch parameters, per-line errors (pure)
  ``serve.py``              ``pdserve batch-server``: the same routes and runner, lines on the pipeline
  ``pipeline_service.py``   PipelineExecutor: batch lines as sequences of one PipelineEngine, on its thread
  ``pipeline/``             the pipeline-parallel engine (TD-Pipe) and ``pdserve batch`` (an offline
                            batch file, no server); read its ``__init__.py``

Arrows: of the prefill (``pdserve.prefill_server``) this package uses only its OpenAI code:
``openai_api`` (validation, error bodies), ``openai_serving`` (a whole response from a request's
choices), ``http_api``'s failure statuses and ``closing``, so a line answers exactly what the
online endpoint would; ``pipeline/`` imports only ``pdserve.engine``. The prefill imports
``api.py`` alone, from its start-up (``prefill_server/wiring.py``), to mount the routes.
"""
