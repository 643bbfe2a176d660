"""spec.auth (API keys at the OpenAI doors) on a real control plane: the API server keeps it on the
InferenceService and on the PrefillPool the operator makes (the schema has it, so it is not pruned); the
router and prefill Deployments mount the Secret read-only and pass --api-key-file, the decodes do not;
taking spec.auth away takes the flag and the volume away; an auth without its Secret's name, or with a
bad Secret key, is refused by the API server with a message naming the field."""

import copy
import json

import yaml

from harness.operator_harness import get_json, names, wait_for
from harness.procs import REPO
from pdserve import defaults

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
KEY_FILE = f"{defaults.API_KEYS_MOUNT}/{defaults.API_KEYS_FILE}"
DEPLOYMENTS = ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]


def isvc_with(auth: dict | None) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    if auth is not None:
        doc["spec"]["auth"] = auth
    return doc


def template(kube, ns: str, name: str) -> dict:
    return get_json(kube, "deployment", name, "-n", ns)["spec"]["template"]["spec"]


def key_file_arg(pod: dict) -> str | None:
    args = pod["containers"][0]["args"]
    return args[args.index("--api-key-file") + 1] if "--api-key-file" in args else None


def test_spec_auth_mounts_the_secret_on_the_router_and_prefills(kube, operator, ns):
    kube.kubectl("create", "secret", "generic", "chat-keys", "-n", ns, "--from-literal=team=alice:sk-not-used-here")
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc_with({"apiKeySecret": "chat-keys",
                                                                           "key": "team"})))
    wait_for(kube, lambda: names(kube, "deployments", ns) == DEPLOYMENTS, "four Deployments", op=operator)
    pool = get_json(kube, "prefillpool", "chat-prefill", "-n", ns)
    assert pool["spec"]["auth"] == {"apiKeySecret": "chat-keys", "key": "team"}
    for name in ("chat-prefill", "chat-router"):
        pod = template(kube, ns, name)
        assert key_file_arg(pod) == KEY_FILE, name
        (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"] == {"secretName": "chat-keys", "defaultMode": 0o440,
                                    "items": [{"key": "team", "path": defaults.API_KEYS_FILE}]}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
        assert mount == {"name": "api-keys", "mountPath": defaults.API_KEYS_MOUNT, "readOnly": True}
    decode = template(kube, ns, "chat-decode-main")
    assert key_file_arg(decode) is None and "api-keys" not in {v["name"] for v in decode["volumes"]}

    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/auth"}]')
    for name in ("chat-prefill", "chat-router"):
        wait_for(kube, lambda name=name: key_file_arg(template(kube, ns, name)) is None,
                 f"{name} without --api-key-file", op=operator)
        assert "api-keys" not in {v["name"] for v in template(kube, ns, name)["volumes"]}


def test_the_key_defaults_to_api_keys(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc_with({"apiKeySecret": "chat-keys"})))
    assert get_json(kube, "pdis", "chat", "-n", ns)["spec"]["auth"]["key"] == defaults.API_KEYS_SECRET_KEY
    wait_for(kube, lambda: "chat-prefill" in names(kube, "deployments", ns), "the prefill Deployment", op=operator)
    (volume,) = [v for v in template(kube, ns, "chat-prefill")["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["items"] == [{"key": defaults.API_KEYS_SECRET_KEY, "path": defaults.API_KEYS_FILE}]


INVALID = [  # (spec.auth, texts the API server's message must contain)
    ({}, ["spec.auth.apiKeySecret", "Required"]),
    ({"apiKeySecret": "Not_A_Name"}, ["spec.auth.apiKeySecret"]),
    ({"apiKeySecret": "chat-keys", "key": "a/b"}, ["spec.auth.key"]),
]


def test_invalid_auth_is_refused_naming_the_field(kube, operator, ns):
    for auth, texts in INVALID:
        done = kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc_with(copy.deepcopy(auth))),
                            check=False)
        assert done.returncode != 0, auth
        for text in texts:
            assert text in done.stderr, done.stderr
