"""The test S3 server keeps its Unix sockets in its own data folder (issue 34): weed's defaults,
``/tmp/seaweedfs-filer-<port>.sock`` and ``/tmp/seaweedfs-s3-<port>.sock``, are paths every network namespace
on the machine shares, so two servers on one port in separate namespaces took each other's sockets."""

from __future__ import annotations

import stat


def test_the_servers_unix_sockets_are_in_its_own_data_folder(tmp_path):
    from s3 import start_server

    server = start_server(tmp_path)
    try:
        for name in ("filer.sock", "s3.sock"):
            path = server.data / name
            assert path.exists() and stat.S_ISSOCK(path.stat().st_mode), name
        server.make_bucket("sockets-check")  # S3 through its filer socket still works
    finally:
        server.stop()
