#!/usr/bin/env bash
# Issue 29 item 3: the file and name renames, as git mv + text substitution over
# every tracked text file. Idempotent: re-run it after merging a branch that still
# uses an old name (a step whose source is gone only rewrites references).
#
#   scripts/rename_29.sh             # all steps, in order
#   scripts/rename_29.sh spec tasks  # some steps (the step_* names below)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

mv_if() { if [ -e "$1" ]; then mkdir -p "$(dirname "$2")"; git mv "$1" "$2"; fi; }

# sub PERL-REGEX REPLACEMENT [PATHSPEC...]: rewrite the tracked files that match;
# ${1}..${3} in REPLACEMENT are the regex's groups.
sub() {
    local re=$1 rep=$2; shift 2
    git ls-files -z -- "${@:-.}" | grep -zv '^scripts/rename_29\.sh$' \
        | xargs -0 grep -lIP -- "$re" 2>/dev/null \
        | while IFS= read -r f; do
              RE=$re REP=$rep perl -0pi -e '
                  s{$ENV{RE}}{my @g = ($1, $2, $3); (my $o = $ENV{REP}) =~ s/\$\{(\d)\}/$g[$1 - 1]/g; $o}ge' "$f"
          done || true
}

step_spec() {  # controlplane/spec/ -> controlplane/servicespec/ (tools read spec/ as a test folder)
    # file by file: after a merge both folders can exist (a `git mv` of the folder
    # would then nest spec/ inside servicespec/)
    git ls-files -z controlplane/spec | while IFS= read -r -d '' f; do
        mv_if "$f" "controlplane/servicespec/${f#controlplane/spec/}"
    done
    rmdir controlplane/spec 2>/dev/null || true
    sub '\bcontrolplane([./])spec\b' 'controlplane${1}servicespec'
    sub '\bfrom (\.+)spec\b' 'from ${1}servicespec' controlplane
    sub '_CP \+ "spec"' '_CP + "servicespec"' scripts/import_graph.py
    # prose that names the package by its folder
    sub '(?<![\w/])spec/(compat|engines|errors|load|schema|service|__init__)\.py' 'servicespec/${1}.py'
    sub "(?<=records, )spec/ {7}" "servicespec/" controlplane/__init__.py
    sub "(?<=records  )spec/ {7}" "servicespec/" docs/architecture.md
    sub '"controlplane" / "spec"' '"controlplane" / "servicespec"' tests/test_layout.py
}

step_rules() {  # servicespec/compat.py -> skyserve_rules.py (proxy/compat.py is the 3.10 shims)
    mv_if controlplane/servicespec/compat.py controlplane/servicespec/skyserve_rules.py
    sub '\bcontrolplane([./])servicespec([./])compat\b' 'controlplane${1}servicespec${2}skyserve_rules'
    sub '\bservicespec/compat\.py\b' 'servicespec/skyserve_rules.py'
    sub "\`compat\.UNSUPPORTED\`" "\`skyserve_rules.UNSUPPORTED\`" controlplane/servicespec/schema.py
}

step_subscriber() {  # tests/proxy/test_subscriber.py tests proxy/sources/redis.py
    mv_if tests/proxy/test_subscriber.py tests/proxy/test_redis_source.py
    sub '\btest_subscriber\b' 'test_redis_source'
}

step_tasks() {  # proxy/tasks.py (stopping tasks) vs reconcile/tasks.py (the launch registry)
    mv_if proxy/tasks.py proxy/stopping.py
    mv_if tests/proxy/test_tasks.py tests/proxy/test_stopping.py
    sub '\bproxy([./])tasks\b' 'proxy${1}stopping'
    sub '\btests/proxy/test_tasks\b' 'tests/proxy/test_stopping'
    sub '(?<=redisurl, )tasks {3}' 'stopping' proxy/__init__.py
    sub '(?<=redisurl  )tasks {3}' 'stopping' docs/architecture.md
}

step_view() {  # ops' status struct ReplicaView -> ReplicaStatusView (proxy.interfaces keeps the Protocol)
    sub '\bReplicaView\b' 'ReplicaStatusView' controlplane tests/controlplane
}

step_plan() {  # reconcile/plan.py (the plan) beside planner.py (its steps) -> serviceplan.py
    mv_if controlplane/reconcile/plan.py controlplane/reconcile/serviceplan.py
    sub '\bcontrolplane([./])reconcile([./])plan\b' 'controlplane${1}reconcile${2}serviceplan'
    sub '\breconcile/plan\.py\b' 'reconcile/serviceplan.py'
    sub "one service's plan \\(\`plan\`\\)" "one service's plan (\`serviceplan\`)" controlplane/reconcile/__init__.py
    sub 'controller: plan → planner → commit → tasks, autoscaling\)' \
        'controller: serviceplan, planner, tasks, autoscaling)    ' docs/architecture.md
}

step_scaling() {  # reconcile/autoscaling.py (the per-service state, signals I/O) vs autoscaler.py (the decisions)
    mv_if controlplane/reconcile/autoscaling.py controlplane/reconcile/scalestate.py
    sub '\breconcile([./])autoscaling\b' 'reconcile${1}scalestate'
    sub '(?<=per-service autoscalers \(`)autoscaling(?=`\))' 'scalestate' controlplane/reconcile/__init__.py
    sub '(?<=planner, tasks, )autoscaling\)    ' 'scalestate)     ' docs/architecture.md
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(spec rules subscriber tasks view plan scaling)
for s in "${steps[@]}"; do "step_$s"; done
# a renamed module can move in its import block: re-sort the files changed here
git diff --name-only -z HEAD -- '*.py' | xargs -0 -r ruff check --select I --fix --quiet
