"""Which end-to-end tests run again in each body-holding deployment form, and why: the one place
that says it (docs/development.md#each-deployment-form).

`make test-e2e` runs every test of tests/e2e with the filter as the shipped sidecar's EnvoyFilter
puts it into Envoy (`request_hold: headers`). `make test-e2e-wasmplugin` and `make
test-e2e-envoygateway` run tests/e2e again with ATMOST_DEPLOYMENT set to the WasmPlugin form and
the Envoy Gateway form (both `request_hold: body`: the request's headers go upstream before the
decision, so only its body is held), and conftest.py keeps only the tests named in PER_FORM. A
test belongs there when its outcome depends on the form; everything else (the ledger's rules,
parsing, fingerprints, responses and receipts, SDK interoperability, parser differentials) is the
same code on the same bytes in every form and runs once.

tests/files/test_deployment_forms.py holds this table to the code: every test that reads the
deployment form (`deployment()`, `deployment_form`, BODY_HOLD_FORMS) is named here, in PER_FORM
or in ONCE with the reason it runs in one form only, and every name here exists.
"""

from __future__ import annotations

# Why a test's outcome depends on the form.
HOLD = ("how the request is held: with `request_hold: body` the request's headers reach the upstream "
        "before the decision, so what a denied or refused call shows the upstream, and how the held "
        "body is released or answered, differ")
NEVER_SENT = ("whether a round provably never left: in the body forms the upstream connection may open "
              "before the decision, so a refused connection is read at another point of the call")
KEY_CARRIERS = ("what the upstream receives: the headers form sets the forwarded `Idempotency-Key` header on "
                "the dispatch, the body forms cannot (their headers left before the decision)")
HEADERS = ("the headers the form lets through: the filter's own refusal of header aliases and of the "
           "headers by which a client steers Envoy's retries and timeouts, in front of the connection "
           "manager and the routes the form renders (Envoy Gateway: per-route filter, zero retries)")
NO_BODY = ("requests without a body (GET streams, DELETE) end at their headers, which the body forms "
           "otherwise let through before the decision")
ROUTES = ("per-route configuration: Envoy Gateway enables the filter on each route, the other forms in "
          "the connection manager")
UPGRADES = ("requests that ask to switch protocols are refused at their headers, which the body forms "
            "otherwise let through before the decision, and may have no body to hold; the route they are "
            "decided by is the form's (Envoy Gateway enables the filter route by route)")

# file -> test function -> why it runs in every form (every parameter of it runs).
PER_FORM: dict[str, dict[str, str]] = {
    "test_approvals.py": {
        "test_a_held_call_is_sent_once_a_person_approves_without_a_retry": HOLD,
        "test_a_held_call_nobody_decides_is_answered_approval_required_at_the_bound": HOLD,
    },
    "test_idempotency.py": {
        "test_same_key_twice_executes_once_and_replays_the_first_result": HOLD,
        "test_overlapping_same_key_calls_execute_once_and_the_other_is_in_progress": HOLD,
        "test_upstream_sees_the_derived_key_and_never_the_permit": KEY_CARRIERS,
        "test_permit_header_is_stripped_from_traffic_that_is_not_a_tool_call": HOLD,
        "test_governed_call_without_a_permit_is_denied_and_not_sent": HOLD,
    },
    "test_permits.py": {
        "test_cap_of_one_under_32_concurrent_new_keys_on_both_workers": HOLD,
        "test_connection_refused_releases_the_slot": NEVER_SENT,
    },
    "test_fail_closed.py": {
        "test_denied_calls_never_reach_the_upstream": HOLD,
        "test_ledger_down_means_denied_and_nothing_executes": HOLD,
    },
    "test_trust_boundary.py": {
        "test_a_continuation_that_never_reached_the_upstream_frees_neither_key_nor_slot": NEVER_SENT,
    },
    "test_mcp_versions.py": {
        "test_bad_bodies_get_documented_errors_and_nothing_is_dispatched": HOLD,
        "test_oversized_body_is_413_and_not_dispatched": HOLD,
        "test_batch_with_tools_call_is_refused_and_nothing_is_dispatched": HOLD,
        "test_mirrored_header_mismatch_is_400_and_never_spends_a_slot": HOLD,
        "test_input_required_without_continuation_is_in_progress_and_continuation_dispatches_once": HOLD,
        "test_get_stream_and_delete_pass_through_untouched": NO_BODY,
    },
    "test_upstream_key_forms.py": {
        "test_ungoverned_call_forwards_only_the_derived_key_in_header_and_meta": KEY_CARRIERS,
        "test_ungoverned_call_with_only_params_idempotency_key_is_rewritten": KEY_CARRIERS,
        "test_messages_other_than_tools_call_forward_only_the_derived_key": KEY_CARRIERS,
        "test_bodiless_requests_forward_only_the_derived_header": NO_BODY,
        "test_governed_call_reads_params_idempotency_key_and_forwards_the_derived_one": KEY_CARRIERS,
        "test_governed_call_whose_key_forms_disagree_is_denied_and_not_sent": HOLD,
        "test_mode_off_forwards_no_key_in_any_form": KEY_CARRIERS,
        "test_each_attempt_records_the_key_its_upstream_received": KEY_CARRIERS,
    },
    "test_external_provider.py": {
        "test_governed_call_goes_to_the_provider_over_verified_tls_and_the_ledger_decides": KEY_CARRIERS,
        "test_a_header_spelled_with_underscores_is_refused_before_the_provider": HEADERS,
    },
    "test_control_headers.py": {
        "test_the_filter_refuses_an_alias_the_connection_manager_lets_in": HEADERS,
        "test_control_without_the_filter_the_alias_reaches_the_upstream": HEADERS,
        "test_retry_headers_are_removed_so_a_governed_call_is_sent_once": HEADERS,
        "test_control_without_the_filter_the_retry_headers_are_obeyed": HEADERS,
        "test_a_client_timeout_header_is_not_applied": HEADERS,
        "test_a_retrying_route_sends_a_governed_call_once": ROUTES,
        "test_control_without_the_filter_the_route_retries": ROUTES,
    },
    "test_upgrades.py": {
        "test_a_websocket_upgrade_is_refused_and_nothing_reaches_the_server": UPGRADES,
        "test_an_upgrade_that_announces_a_body_is_refused_before_any_byte_of_it": UPGRADES,
        "test_a_connect_tunnel_is_refused": UPGRADES,
        "test_a_route_upgrade_routes_names_lets_its_upgrade_through_unread": UPGRADES,
    },
    "test_envoy_mcp_filter.py": {
        "test_a_governed_call_is_decided_once_and_its_replay_runs_nothing": HOLD,
        "test_what_the_mcp_filter_or_rbac_refuses_never_runs": HOLD,
        "test_what_atmost_refuses_stays_refused_with_its_code": HOLD,
        "test_a_replay_meets_the_mcp_filter_only_in_front_of_atmost": HOLD,
    },
}

# file -> test function -> why a test that reads the deployment form runs in one form only.
ONCE: dict[str, dict[str, str]] = {
    "test_parser_differentials.py": {
        "test_every_hostile_body_is_refused_before_any_upstream": (
            "a parser differential: the filter reads the same bytes in every form; that a refused body "
            "shows the upstream nothing but a request start in the body forms is "
            "test_mcp_versions.py::test_bad_bodies_get_documented_errors_and_nothing_is_dispatched, run in each"),
    },
    "test_control_headers.py": {
        "test_the_shipped_connection_manager_refuses_an_alias_before_the_filter": (
            "its Envoy is always the shipped sidecar's EnvoyFilter form, whatever ATMOST_DEPLOYMENT says"),
    },
}
