"""A local stand-in for the Hugging Face Hub: the requests huggingface_hub's create_repo and upload_folder make (repo
create, preupload, commit as ndjson; a model card's metadata validation), in a thread of the test process. Preupload
answers every file "regular", so the commit carries each file inline (base64): ``files`` holds what arrived, byte for
byte.

    with HubStandIn() as hub:                   # HF_ENDPOINT=hub.url for the process that uploads
        ...
        hub.files["tester/run/model.safetensors"]  # bytes received
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USER = "tester"  # the namespace of a repo id given without one (the token's user, on the real hub)


class HubStandIn:
    def __init__(self, refuse_commits: bool = False) -> None:
        self.files: dict[str, bytes] = {}  # "repo_id/path" -> content
        self.created: list[dict] = []  # create_repo payloads
        self.cards: list[str] = []  # model cards' texts whose metadata was validated
        self.unexpected: list[str] = []  # requests the stand-in does not implement
        self.tokens: set[str] = set()  # the bearer tokens the requests carried
        self.refuse_commits = refuse_commits  # answer commits 403, as the hub does without write access
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def received(self, repo_id: str) -> dict[str, bytes]:
        return {k.removeprefix(f"{repo_id}/"): v for k, v in self.files.items() if k.startswith(f"{repo_id}/")}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                if "error" in body:  # where the hub puts the reason huggingface_hub shows
                    self.send_header("X-Error-Message", body["error"])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.tokens.add(self.headers.get("Authorization", "").removeprefix("Bearer "))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    payload = json.loads(body)
                    hub.created.append(payload)
                    return self._reply(
                        200, {"url": f"{hub.url}/{payload.get('organization') or USER}/{payload['name']}"}
                    )
                if path == "/api/validate-yaml":  # a README.md's metadata header, checked before its upload
                    hub.cards.append(json.loads(body).get("content", ""))
                    return self._reply(200, {"errors": [], "warnings": []})
                if m := re.fullmatch(r"/api/models/(.+)/preupload/[^/]+", path):
                    return self._reply(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                for f in json.loads(body)["files"]
                            ]
                        },
                    )
                if m := re.fullmatch(r"/api/models/(.+)/commit/[^/]+", path):
                    if hub.refuse_commits:
                        return self._reply(403, {"error": "You don't have the rights to create a commit"})
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            value = item["value"]
                            assert value["encoding"] == "base64"
                            hub.files[f"{m[1]}/{value['path']}"] = base64.b64decode(value["content"])
                        elif item["key"] != "header":
                            hub.unexpected.append(f"commit item {item['key']}")
                    return self._reply(
                        200,
                        {
                            "commitUrl": f"{hub.url}/{m[1]}/commit/{'0' * 40}",
                            "commitOid": "0" * 40,
                            "pullRequestUrl": None,
                        },
                    )
                hub.unexpected.append(f"POST {self.path}")
                self._reply(404, {"error": "not in the stand-in"})

            def do_GET(self) -> None:
                hub.unexpected.append(f"GET {self.path}")
                self._reply(404, {"error": "not in the stand-in"})

        return Handler
