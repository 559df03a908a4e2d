"""Adversarial tests for tenant isolation and resource limits, one file per property held.

Every test plays an untrusted peer against a real daemon process (the ``start_daemon``
fixture of tests/conftest.py): raw frames where the client library would not send the bad
input, and forked children that drop to uid 65534 (``nobody``) or 65533 for other tenants
(_util.as_uid; the root-only tests skip when not run as root). Each file is named by
the property it checks (docs/reliability.md's threat table cites them).

To run this suite against another checkout (e.g. the code before a fix), copy it into
that tree so that its own tests/conftest.py is used:

    cp -r tests/security /tmp/other/tests/ && cd /tmp/other && \
        PYTHONPATH=/tmp/other /path/to/.venv/bin/pytest -q -p no:cacheprovider tests/security
"""
