//! Black-box tests: a real payledger server on an ephemeral port, driven through the
//! generated tonic clients, with a fresh database per test. The suite in `cases` is written
//! once and instantiated for every backend below.
//!
//! SQLite always runs. PostgreSQL and MySQL/MariaDB run when `PAYLEDGER_TEST_POSTGRES_URL`
//! and `PAYLEDGER_TEST_MYSQL_URL` hold admin URLs; without them they are reported as not
//! configured, except under `CI=true`, where a missing backend fails the run. The cases of the
//! Redis token store need `PAYLEDGER_TEST_REDIS_URL` in the same way.

mod auth_cases;
mod cases;
mod helpers;
mod http_cases;
mod lifecycle_cases;

/// The options of a case: the default server, or the one named after `=>`.
macro_rules! options {
    () => {
        crate::helpers::TestOptions::default()
    };
    ($options:ident) => {
        crate::helpers::TestOptions::$options()
    };
}

macro_rules! suite_for_backend {
    ($module:ident, $backend:expr, [$($case:ident $(=> $options:ident)?),* $(,)?]) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    crate::helpers::run($backend, options!($($options)?), crate::cases::$case).await;
                }
            )*
        }
    };
}

/// Instantiates every case for every backend. `case => options` runs the case on a server
/// built with `TestOptions::options()`.
macro_rules! backend_suite {
    ($($case:ident $(=> $options:ident)?),* $(,)?) => {
        suite_for_backend!(sqlite, crate::helpers::Backend::Sqlite, [$($case $(=> $options)?),*]);
        suite_for_backend!(postgres, crate::helpers::Backend::Postgres, [$($case $(=> $options)?),*]);
        suite_for_backend!(mysql, crate::helpers::Backend::MySql, [$($case $(=> $options)?),*]);
    };
}

/// Cases that hold rows in one transaction while another writes: on SQLite (one writer at a
/// time, no row locks) the other writer cannot start, so there the harness lists them as
/// ignored, with the reason, instead of running them.
macro_rules! row_lock_suite {
    ($($case:ident $(=> $options:ident)?),* $(,)?) => {
        mod row_locks {
            suite_for_backend!(postgres, crate::helpers::Backend::Postgres, [$($case $(=> $options)?),*]);
            suite_for_backend!(mysql, crate::helpers::Backend::MySql, [$($case $(=> $options)?),*]);
            mod sqlite {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    #[ignore = "SQLite has one writer at a time and no row locks: the case holds rows in one transaction while another writes"]
                    async fn $case() {
                        crate::helpers::run(crate::helpers::Backend::Sqlite, options!($($options)?), crate::cases::$case).await;
                    }
                )*
            }
        }
    };
}

row_lock_suite!(
    a_batch_waiting_for_a_row_lock_does_not_hold_up_the_next_batch => two_batches_in_flight,
    a_second_caller_is_served_beside_a_batch_of_one_waiting_for_a_row_lock,
    a_refused_withdraw_waits_for_its_request_id_in_flight_and_is_answered_by_it,
    a_refused_withdraw_whose_request_id_in_flight_rolls_back_stays_refused,
    a_refused_pay_waits_for_its_out_trade_no_in_flight_and_is_answered_by_it => one_by_one,
    the_sweeper_skips_an_order_another_transaction_holds,
    a_retry_its_batch_found_answered_stays_answered_when_its_key_expires_under_the_batch => short_lived,
);

backend_suite!(
    open_account_is_replayed_and_a_different_currency_is_already_exists,
    deposit_credits_the_account_and_a_repeated_request_id_is_a_replay,
    deposit_into_a_missing_account_or_in_another_currency_is_refused,
    list_entries_pages_newest_first,
    create_order_is_replayed_and_other_fields_are_already_exists,
    create_order_for_a_missing_payee_is_not_found,
    pay_moves_the_order_amount_from_payer_to_payee_once,
    pay_retried_with_the_same_out_trade_no_is_replayed_with_the_original_trade_no,
    pay_with_a_used_out_trade_no_and_other_fields_names_the_differing_fields,
    a_second_out_trade_no_for_a_paid_order_moves_no_money,
    pay_refuses_mismatched_amount_currency_and_self_payment_leaving_nothing,
    pay_without_funds_leaves_nothing_and_succeeds_after_a_deposit,
    close_order_closes_once_and_refuses_paid_orders,
    partial_then_full_refunds_move_money_back_and_replays_do_not,
    refund_of_an_unknown_payment_or_without_an_amount_is_refused,
    query_finds_the_order_by_each_business_number,
    bad_input_is_invalid_argument_naming_every_bad_field_and_leaves_nothing,
    yen_and_dinar_amounts_follow_their_minor_units,
    twenty_concurrent_identical_pays_execute_once_with_one_trade_no,
    concurrent_pays_against_one_balance_never_overdraw_it,
    concurrent_partial_refunds_never_exceed_the_paid_amount,
    a_query_racing_refunds_answers_one_moment,
    opposite_payments_between_two_accounts_finish_without_deadlock,
    a_pay_whose_client_gave_up_is_all_or_nothing_and_a_retry_is_exact,
    health_is_serving_and_reflection_lists_both_services,
    audit_reports_a_balance_that_disagrees_with_its_entries,
    the_audit_finds_legs_that_are_not_their_rows_statuses_that_misstate_refunds_and_rewritten_history,
    the_hash_chain_finds_rewritten_history_and_the_digest_what_was_rewritten_consistently,
    an_audit_from_a_checkpoint_finds_a_posting_deleted_whole_after_it,
    the_audit_finds_close_reasons_the_history_does_not_explain,
    an_audit_from_a_checkpoint_finds_what_breaks_the_entries_written_since,
    fifty_concurrent_transfers_with_one_idempotency_key_move_money_once,
    an_idempotency_key_reused_for_another_request_is_already_exists,
    transfer_requires_an_idempotency_key,
    a_failed_transfer_leaves_no_record_and_its_retry_runs_afresh,
    a_pay_with_an_idempotency_key_replays_the_stored_response_and_says_until_when,
    a_duplicate_in_flight_past_the_lock_timeout_is_aborted_then_runs => short_lock_timeout,
    fifty_concurrent_requests_presenting_one_token_run_exactly_once,
    fifty_concurrent_requests_presenting_one_redis_token_run_exactly_once => redis,
    an_expired_unknown_or_foreign_token_is_token_invalid => short_lived,
    a_token_whose_business_change_failed_can_be_presented_again,
    a_redis_token_whose_business_change_failed_is_restored => redis,
    a_redis_token_forgotten_by_a_failover_never_charges_twice => redis,
    the_reaper_deletes_expired_keys_in_batches_while_pays_run,
    a_pay_retried_after_its_key_expired_is_still_a_replay => short_lived,
    a_pay_whose_response_is_lost_is_retried_and_answered_with_the_original_trade_no,
    a_pay_cut_after_its_answers_headers_is_retried_and_moves_the_money_once,
    a_pay_on_a_connection_gone_silent_is_retried_on_another_and_moves_the_money_once,
    a_pay_whose_attempts_outlive_their_deadline_is_retried_and_moves_the_money_once,
    a_caller_branches_on_the_typed_reason_of_a_refusal,
    every_bench_scenario_runs_clean_and_keeps_the_ledger_sound,
    a_malformed_protobuf_message_is_invalid_argument,
    a_call_answered_by_its_natural_key_leaves_no_half_done_idempotency_record,
    one_group_commit_decides_each_pay_on_its_own,
    pays_decided_from_known_rows_that_moved_meanwhile_are_read_again_and_move_money_once,
    one_group_commit_of_keyed_and_token_pays_decides_each_on_its_own,
    a_key_taken_under_a_group_commit_is_replayed_and_the_pays_after_it_are_applied_again,
    one_group_commit_of_pays_and_refunds_decides_each_on_its_own,
    a_refund_committed_under_a_group_commit_is_replayed_and_the_next_refund_applies_on_top,
    one_group_commit_of_transfers_and_pays_decides_each_on_its_own,
    a_key_taken_under_a_group_commit_is_replayed_and_the_transfers_after_it_are_applied_again,
    one_group_commit_of_deposits_and_withdrawals_decides_each_on_its_own,
    a_request_id_taken_under_a_group_commit_is_replayed_and_the_rest_of_it_commits,
    one_group_commit_of_create_orders_decides_each_on_its_own,
    an_order_created_under_a_group_commit_is_replayed_and_the_rest_of_it_commits,
    a_call_whose_original_commits_under_its_batch_is_answered_by_its_key_record,
    racing_calls_with_one_key_and_other_terms_are_answered_by_the_key,
    deposits_over_funding_shards_are_group_committed_once_each_shard_exists => four_funding_shards,
    a_transfer_retried_while_its_original_commits_is_replayed_not_refused,
    concurrent_pays_to_one_merchant_are_grouped_and_each_moves_money_once,
    idempotency_keys_that_differ_by_spaces_or_case_mean_the_same_on_every_backend,
    business_numbers_tokens_and_currencies_compare_byte_for_byte_on_every_backend,
    ambiguous_headers_and_page_tokens_are_invalid_argument_and_write_nothing,
    records_replay_the_response_as_sent_and_records_of_the_previous_release_still_replay,
    guard_headers_sent_in_request_trailers_are_invalid_argument_and_move_nothing,
    a_used_token_answers_only_its_own_merchant_in_the_database_store,
    a_used_token_answers_only_its_own_merchant_in_the_redis_store => redis,
    a_token_whose_call_changed_nothing_stays_usable_in_the_database_store,
    a_token_whose_call_changed_nothing_stays_usable_in_the_redis_store => redis,
    concurrent_duplicates_of_a_keyed_pay_are_answered_from_its_key_record,
    // Order expiry and payouts.
    an_order_past_its_expires_at_refuses_pay_before_and_after_the_sweeper_closes_it,
    expires_at_must_be_a_valid_future_timestamp_and_is_part_of_the_orders_terms,
    an_order_without_expires_at_gets_the_servers_default_lifetime => short_order_ttl,
    pays_racing_the_expiry_sweeper_end_with_exactly_one_winner_per_order,
    withdraw_pays_out_once_per_request_id_and_refuses_what_it_cannot_pay,
    deposits_and_withdrawals_spread_over_the_funding_shards_and_the_audit_sums_them => four_funding_shards,
    deposits_and_withdrawals_go_round_past_the_one_way_limit,
    withdrawals_racing_pays_on_one_account_never_overdraw_it,
    a_hold_reserves_the_available_balance_and_a_partial_capture_pays_like_a_pay,
    a_deposit_or_withdraw_replayed_by_its_request_id_answers_the_account_as_it_stood,
    get_account_answers_one_moment_while_pays_and_holds_move_the_account,
    funding_replays_as_they_stood_one_by_one => one_by_one,
    every_natural_replay_answers_what_its_original_answered_after_later_steps_moved_its_order,
    natural_replays_as_they_stood_one_by_one => one_by_one,
    replays_racing_refunds_of_their_order_each_answer_their_original,
    void_close_order_and_expiry_release_a_hold_and_a_released_hold_replays,
    a_hold_past_its_expires_at_refuses_capture_and_the_sweeper_releases_it => short_hold_ttl,
    captures_void_and_close_order_racing_on_one_hold_end_with_one_winner,
    captures_racing_the_hold_sweeper_end_with_one_winner => short_hold_ttl,
    // The trust boundary, on a server that authenticates callers.
    every_rpc_refuses_every_bad_credential_and_caller_outside_its_grant_leaving_nothing => authenticated,
    tokens_of_each_algorithm_verify_and_ambiguous_credentials_are_refused => authenticated,
    callers_reach_only_their_merchants_objects_and_their_own_idempotency_records => authenticated,
    created_by_is_anonymous_on_a_server_without_authentication,
    a_key_used_before_authentication_was_turned_on_answers_its_retry_after,
    a_batch_answers_its_keyed_calls_from_records_made_before_and_after_authentication,
    every_bench_scenario_runs_clean_with_a_token => authenticated,
    callers_are_kept_apart_with_redis_tokens => authenticated_redis,
    the_demo_plays_clean_against_a_running_server => authenticated,
    // HTTP/JSON (the same guarantees over HTTP/1.1 and HTTP/2 cleartext).
    http_json_pays_once_and_replays_by_key_and_by_natural_key,
    concurrent_http_duplicates_of_a_keyed_pay_move_the_money_once,
    http_refusals_carry_their_status_and_a_google_rpc_status_body_and_leave_nothing,
    http_callers_need_a_valid_bearer_token_and_reach_only_their_merchants => authenticated,
    the_served_openapi_document_is_the_one_generated_from_the_proto,
    // Operability.
    metrics_count_calls_replays_key_conflicts_and_refusals,
    a_call_past_the_concurrency_limit_is_resource_exhausted_before_any_work => tightly_bounded,
    a_call_past_its_deadline_is_deadline_exceeded_and_its_retry_moves_the_money_once,
    a_full_group_commit_queue_refuses_and_a_gone_callers_pay_never_starts => tightly_bounded,
    a_request_over_the_size_limit_is_resource_exhausted,
    a_request_with_broken_framing_is_invalid_argument,
    // The same cases with group commit off: every call alone, a batch of one.
    twenty_concurrent_identical_pays_one_by_one => one_by_one,
    racing_calls_with_one_key_and_other_terms_one_by_one => one_by_one,
    concurrent_pays_against_one_balance_one_by_one => one_by_one,
    opposite_payments_between_two_accounts_one_by_one => one_by_one,
    pay_without_funds_one_by_one => one_by_one,
    pay_refusals_one_by_one => one_by_one,
    concurrent_partial_refunds_one_by_one => one_by_one,
    create_order_for_a_missing_payee_one_by_one => one_by_one,
    create_order_replays_one_by_one => one_by_one,
    deposit_replays_one_by_one => one_by_one,
    deposit_refusals_one_by_one => one_by_one,
    every_bench_scenario_one_by_one => one_by_one,
    fifty_requests_with_one_token_one_by_one => one_by_one,
    fifty_keyed_transfers_one_by_one => one_by_one,
    a_failed_transfer_one_by_one => one_by_one,
    refunds_one_by_one => one_by_one,
    refund_refusals_one_by_one => one_by_one,
    deposits_and_withdrawals_over_new_funding_shards_one_by_one => four_funding_shards_one_by_one,
);
