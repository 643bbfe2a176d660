"""`helm test`: one completion through an InferenceService's Service (templates/tests/completion.yaml).

Reads PDSERVE_TEST_URL (http://<service>.<namespace>.svc:<port>), PDSERVE_TEST_MODEL (empty: the first
model /v1/models lists) and PDSERVE_TEST_TIMEOUT_S. Exits 0 after one answered completion; anything else
(no connection, an HTTP error, an answer without choices) exits 1 with the reason, which `helm test --logs`
and `kubectl logs` show. Standard library only: it runs on the pdserve image's Python.
"""

import json
import os
import sys
import urllib.error
import urllib.request

URL = os.environ["PDSERVE_TEST_URL"].rstrip("/")
TIMEOUT_S = float(os.environ.get("PDSERVE_TEST_TIMEOUT_S") or 120)


def call(path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(URL + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        sys.exit(f"FAIL: {URL}{path} answered HTTP {exc.code}: {exc.read().decode(errors='replace')[:1000]}")
    except (OSError, ValueError) as exc:  # refused, unresolved, timed out, not JSON
        sys.exit(f"FAIL: {URL}{path}: {exc}")


def main() -> None:
    model = os.environ.get("PDSERVE_TEST_MODEL")
    if not model:
        listed = call("/v1/models").get("data") or []
        if not listed:
            sys.exit(f"FAIL: {URL}/v1/models lists no model")
        model = listed[0]["id"]
    answer = call("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8})
    choices = answer.get("choices") or []
    if not choices or not choices[0].get("finish_reason"):
        sys.exit(f"FAIL: {URL}/v1/completions answered without a finished choice: {json.dumps(answer)[:1000]}")
    print(f"ok: {URL} model {model!r} answered {choices[0].get('text')!r} (finish_reason "
          f"{choices[0]['finish_reason']})")


if __name__ == "__main__":
    main()
