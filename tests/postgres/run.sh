#!/usr/bin/env bash
# The PostgreSQL journal against a real server: a throwaway cluster
# (Debian's postgresql, run as an unprivileged user, on a loopback port),
# once for all of it. First the tests that need it by name (`--ignored`:
# storage's PostgreSQL engine, the bins on a PostgreSQL journal), then the
# crash, recovery, fault and property suites again with every test node's
# journal in it (ARBOR_TEST_JOURNAL=postgres, arbor-testkit's backend.rs).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
fi

work=$(mktemp -d)
chmod 755 "$work" # the cluster's owner (nobody, under root) must reach it
trap 'bash tests/postgres/cluster.sh stop "$work/cluster" || true; rm -rf "$work"' EXIT
ARBOR_TEST_DATABASE_URL=$(bash tests/postgres/cluster.sh start "$work/cluster")
export ARBOR_TEST_DATABASE_URL
echo "postgres: a throwaway cluster at $ARBOR_TEST_DATABASE_URL"

cargo test --workspace --locked -q -- --ignored

ARBOR_TEST_JOURNAL=postgres cargo test --locked -q -p arbor-tests \
  --test recovery --test durability --test faults \
  --test approvals --test ledger_properties --test delegation --test budgets \
  --test cancellation --test steering

# The crash exploration on PostgreSQL: the scenarios whose commit points the
# engine decides (a lease's renewal and takeover, which sled has not; a change
# and its audit entry in one transaction; a grant raised by a ledger entry).
# The others explore the actors' recovery, which is the same on either
# journal, and run on sled above.
ARBOR_TEST_JOURNAL=postgres cargo test --locked -q -p arbor-tests \
  --test crash_exploration -- \
  every_commit_point_of_a_fan_out_with_retries_and_a_steer_recovers \
  inv_64_every_commit_point_of_an_audited_call_keeps_change_and_entry_together \
  inv_58_every_commit_point_of_a_top_up_keeps_the_grant_once
