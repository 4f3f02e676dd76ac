"""A pod that is not a real engine, for the operator's pool probe: ready, but its /v1/kvpool
answers garbage (`garbage`) or drops the connection (`drop`).

    python fake_pool_server.py garbage|drop PORT
"""

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    mode = "garbage"

    def do_GET(self) -> None:
        if self.path == "/v1/kvpool" and self.mode == "drop":
            self.close_connection = True
            self.connection.close()
            return
        body = b'{"pool_tokens": "lots", "role": 7}' if self.path == "/v1/kvpool" else b"ok"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    Handler.mode = sys.argv[1]
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()
