#!/usr/bin/env bash
# The project's test command (called by `make test` and CI): lint, types, migrations check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
export PATH="$PWD/$BIN:$PATH"

# PostgreSQL for the database tests; tests marked `postgres` skip with a reason when it is absent.
export GREENFLOW_TEST_POSTGRES_URL="${GREENFLOW_TEST_POSTGRES_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}"

echo "== ruff"; ruff check .
ruff format --check scheduler_service energy_model worker_agent tests bench migrations
echo "== mypy"; mypy scheduler_service energy_model worker_agent tests bench migrations examples
echo "== alembic (upgrade + check, SQLite)"
tmpdb="$(mktemp -d)/check.db"
GREENFLOW_DATABASE_URL="sqlite:///$tmpdb" greenflow db upgrade
GREENFLOW_DATABASE_URL="sqlite:///$tmpdb" alembic check
if [ "$#" -eq 0 ]; then
  # On their own, so the log says how many ran and, where namespaces cannot be made, why not.
  echo "== pytest: multi-node (network namespaces, veth links)"
  pytest -q -p no:cacheprovider -rs tests/multinode
  # Schemathesis collects one item per API operation under a shared id, which xdist would run
  # once per id: it runs in one process, so that every operation is exercised.
  echo "== pytest: API schema (schemathesis, every operation)"
  pytest -q -p no:cacheprovider tests/api/test_schemathesis.py
  echo "== pytest (${GREENFLOW_TEST_WORKERS:-2} processes)"
  pytest -q -p no:cacheprovider -n "${GREENFLOW_TEST_WORKERS:-2}" --dist loadfile \
    --durations=15 --ignore=tests/multinode --ignore=tests/api/test_schemathesis.py
else
  echo "== pytest"
  pytest -q -p no:cacheprovider "$@"
fi
