"""The trust boundary as a Python grpcio caller sees it, against a real `payledger serve`
with mutual TLS and JWT authentication (started by .ci/python_contract.sh).

Usage: auth_contract.py ADDRESS CERT_DIR PAYLEDGER_BINARY KEY_FILE
"""

import subprocess
import time
import sys
import uuid

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from google.protobuf import timestamp_pb2

import payledger_pb2 as pb
import payledger_pb2_grpc as rpc

ADDRESS, CERTS, BINARY, KEY = sys.argv[1:5]
ALL = "payments:write payments:read accounts:write accounts:read accounts:admin"


def read(name):
    with open(f"{CERTS}/{name}", "rb") as file:
        return file.read()


def mint(sub, merchants, scope, ttl="600"):
    return subprocess.run(
        [BINARY, "auth", "mint", "--key", KEY, "--sub", sub, "--merchants", merchants, "--scope", scope,
         "--ttl-seconds", ttl],
        check=True, capture_output=True, text=True,
    ).stdout.strip()


def channel(with_client_cert=True):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read("ca.pem"),
        private_key=read("client-key.pem") if with_client_cert else None,
        certificate_chain=read("client.pem") if with_client_cert else None,
    )
    return grpc.secure_channel(ADDRESS, credentials, options=[("grpc.ssl_target_name_override", "localhost")])


def reason(error):
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status in {error}"
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason, dict(info.metadata)
    raise AssertionError(f"no ErrorInfo in {error}")


def refused(call, code, expected_reason):
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() == code, f"{error.code()} != {code}: {error.details()}"
        got, metadata = reason(error)
        assert got == expected_reason, f"{got} != {expected_reason}"
        return metadata, error.details()
    raise AssertionError(f"expected {code} {expected_reason}, the call succeeded")


def auth(token):
    return (("authorization", f"Bearer {token}"),)


def main():
    run = uuid.uuid4().hex[:8]
    admin, shop_a, shop_b = mint("ops", "*", ALL), mint("shop-a", "m1", "payments:write payments:read"), mint(
        "shop-b", "m2", "payments:write payments:read")
    reader = mint("auditor", "m1", "payments:read")
    expired = mint("ops", "*", ALL, ttl="1")  # the server runs with --auth-leeway-seconds 0
    ch = channel()
    accounts, payments = rpc.AccountServiceStub(ch), rpc.PaymentServiceStub(ch)

    # Health needs no credential, even with authentication on.
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    payer, payee = f"payer-{run}", f"shop-{run}"
    for account in (payer, payee):
        accounts.OpenAccount(pb.OpenAccountRequest(account_id=account, currency="USD"), metadata=auth(admin))
    accounts.Deposit(pb.DepositRequest(request_id=f"d-{run}", account_id=payer, amount="50.00", currency="USD"),
                     metadata=auth(admin))
    order = pb.CreateOrderRequest(merchant_id="m1", order_no=f"o-{run}", payee_account_id=payee, amount="20.00",
                                  currency="USD", subject="tea")
    pay = pb.PayRequest(merchant_id="m1", out_trade_no=f"t-{run}", order_no=f"o-{run}", payer_account_id=payer,
                        amount="20.00", currency="USD")

    # Every refusal, as a Python caller decodes it.
    time.sleep(2)  # `expired` is past its exp by now
    refused(lambda: payments.CreateOrder(order), grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_MISSING")
    refused(lambda: payments.CreateOrder(order, metadata=(("authorization", "Bearer x.y.z"),)),
            grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_INVALID")
    _, message = refused(lambda: payments.CreateOrder(order, metadata=auth(expired)),
                         grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_EXPIRED")
    assert expired not in message, "the message echoes the token"
    refused(lambda: payments.CreateOrder(order, metadata=auth(shop_b)), grpc.StatusCode.PERMISSION_DENIED,
            "MERCHANT_NOT_ALLOWED")
    metadata, _ = refused(lambda: payments.CreateOrder(order, metadata=auth(reader)),
                          grpc.StatusCode.PERMISSION_DENIED, "SCOPE_MISSING")
    assert metadata.get("scope") == "payments:write", metadata
    refused(lambda: accounts.GetAccount(pb.GetAccountRequest(account_id=payer), metadata=auth(shop_a)),
            grpc.StatusCode.PERMISSION_DENIED, "SCOPE_MISSING")

    # The caller's own merchant works, and the payment says who made it.
    payments.CreateOrder(order, metadata=auth(shop_a))
    paid, call = payments.Pay.with_call(pay, metadata=auth(shop_a) + (("idempotency-key", f"k-{run}"),))
    assert paid.payment.created_by == "shop-a", paid.payment
    again, call = payments.Pay.with_call(pay, metadata=auth(shop_a) + (("idempotency-key", f"k-{run}"),))
    assert dict(call.initial_metadata()).get("idempotent-replayed") == "true"
    assert again.payment.trade_no == paid.payment.trade_no
    # Another merchant's numbers do not exist for shop-b.
    refused(lambda: payments.Query(pb.QueryRequest(merchant_id="m2", out_trade_no=f"t-{run}"), metadata=auth(shop_b)),
            grpc.StatusCode.NOT_FOUND, "PAYMENT_NOT_FOUND")
    found = payments.Query(pb.QueryRequest(merchant_id="m1", out_trade_no=f"t-{run}"), metadata=auth(reader))
    assert found.payment.created_by == "shop-a"
    balance = accounts.GetAccount(pb.GetAccountRequest(account_id=payer), metadata=auth(admin)).account.balance
    assert balance == "30.00", balance

    # Payouts: Withdraw replays by request_id, refuses a short balance, needs accounts:admin.
    withdraw = pb.WithdrawRequest(request_id=f"w-{run}", account_id=payer, amount="10.00", currency="USD")
    out = accounts.Withdraw(withdraw, metadata=auth(admin))
    assert (out.account.balance, out.entry.amount) == ("20.00", "-10.00"), out
    assert out.entry.kind == pb.ENTRY_KIND_WITHDRAWAL, out.entry
    again, call = accounts.Withdraw.with_call(withdraw, metadata=auth(admin))
    assert dict(call.initial_metadata()).get("idempotent-replayed") == "true" and again == out
    refused(lambda: accounts.Withdraw(pb.WithdrawRequest(request_id=f"w2-{run}", account_id=payer, amount="20.01",
                                                         currency="USD"), metadata=auth(admin)),
            grpc.StatusCode.FAILED_PRECONDITION, "INSUFFICIENT_FUNDS")
    metadata, _ = refused(lambda: accounts.Withdraw(withdraw, metadata=auth(shop_a)),
                          grpc.StatusCode.PERMISSION_DENIED, "SCOPE_MISSING")
    assert metadata.get("scope") == "accounts:admin", metadata

    # Order expiry: expires_at kept to the microsecond; a late Pay is ORDER_EXPIRED; a past
    # expires_at is INVALID_ARGUMENT naming the field.
    deadline = timestamp_pb2.Timestamp(seconds=int(time.time()) + 1, nanos=123_456_789)
    late_order = pb.CreateOrderRequest(merchant_id="m1", order_no=f"o2-{run}", payee_account_id=payee,
                                       amount="1.00", currency="USD", expires_at=deadline)
    created = payments.CreateOrder(late_order, metadata=auth(shop_a)).order
    assert (created.expires_at.seconds, created.expires_at.nanos) == (deadline.seconds, 123_456_000), created
    time.sleep(max(0.0, deadline.seconds + 0.2 - time.time()))
    late_pay = pb.PayRequest(merchant_id="m1", out_trade_no=f"t2-{run}", order_no=f"o2-{run}", payer_account_id=payer,
                             amount="1.00", currency="USD")
    refused(lambda: payments.Pay(late_pay, metadata=auth(shop_a)), grpc.StatusCode.FAILED_PRECONDITION,
            "ORDER_EXPIRED")
    past = pb.CreateOrderRequest(merchant_id="m1", order_no=f"o3-{run}", payee_account_id=payee, amount="1.00",
                                 currency="USD", expires_at=timestamp_pb2.Timestamp(seconds=int(time.time()) - 1))
    try:
        payments.CreateOrder(past, metadata=auth(shop_a))
        raise AssertionError("an order that expired before it was made was created")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        status = rpc_status.from_call(error)
        fields = []
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                fields = [violation.field for violation in bad.field_violations]
        assert fields == ["expires_at"], fields

    # Authorization holds: Authorize reserves (available_balance drops, balance does not),
    # Capture pays part of it as a Pay would, a second Capture is refused, Void of another
    # hold releases it and replays.
    for suffix in ("h1", "h2"):
        payments.CreateOrder(pb.CreateOrderRequest(merchant_id="m1", order_no=f"{suffix}-{run}", payee_account_id=payee,
                                                   amount="8.00", currency="USD"), metadata=auth(shop_a))
        held = payments.Authorize(pb.AuthorizeRequest(merchant_id="m1", out_auth_no=f"a-{suffix}-{run}",
                                                      order_no=f"{suffix}-{run}", payer_account_id=payer,
                                                      amount="8.00", currency="USD"), metadata=auth(shop_a))
        assert held.hold.status == pb.HOLD_STATUS_ACTIVE and held.order.status == pb.ORDER_STATUS_AUTHORIZED, held
    account = accounts.GetAccount(pb.GetAccountRequest(account_id=payer), metadata=auth(admin)).account
    assert (account.balance, account.available_balance) == ("20.00", "4.00"), account
    capture = pb.CaptureRequest(merchant_id="m1", out_auth_no=f"a-h1-{run}", out_trade_no=f"c-{run}", amount="5.00",
                                currency="USD")
    captured = payments.Capture(capture, metadata=auth(shop_a))
    assert (captured.order.status, captured.order.amount, captured.payment.amount) == (pb.ORDER_STATUS_PAID, "5.00", "5.00")
    again, call = payments.Capture.with_call(capture, metadata=auth(shop_a))
    assert dict(call.initial_metadata()).get("idempotent-replayed") == "true" and again.payment == captured.payment
    refused(lambda: payments.Capture(pb.CaptureRequest(merchant_id="m1", out_auth_no=f"a-h1-{run}",
                                                       out_trade_no=f"c2-{run}", amount="1.00", currency="USD"),
                                     metadata=auth(shop_a)), grpc.StatusCode.FAILED_PRECONDITION, "ORDER_ALREADY_PAID")
    voided = payments.Void(pb.VoidRequest(merchant_id="m1", out_auth_no=f"a-h2-{run}"), metadata=auth(shop_a))
    assert voided.order.close_reason == pb.ORDER_CLOSE_REASON_VOIDED, voided
    _, call = payments.Void.with_call(pb.VoidRequest(merchant_id="m1", out_auth_no=f"a-h2-{run}"), metadata=auth(shop_a))
    assert dict(call.initial_metadata()).get("idempotent-replayed") == "true"
    refused(lambda: payments.Void(pb.VoidRequest(merchant_id="m2", out_auth_no=f"a-h2-{run}"), metadata=auth(shop_b)),
            grpc.StatusCode.NOT_FOUND, "HOLD_NOT_FOUND")
    account = accounts.GetAccount(pb.GetAccountRequest(account_id=payer), metadata=auth(admin)).account
    assert (account.balance, account.available_balance) == ("15.00", "15.00"), account

    # A message over the size limit: RESOURCE_EXHAUSTED with its reason, nothing written.
    huge = pb.PayRequest(merchant_id="m1", out_trade_no="x" * (100 * 1024), order_no=f"o-{run}",
                         payer_account_id=payer, amount="20.00", currency="USD")
    refused(lambda: payments.Pay(huge, metadata=auth(shop_a)), grpc.StatusCode.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE")

    # `payledger health`, as a container HEALTHCHECK runs it, over mutual TLS.
    probe = subprocess.run(
        [BINARY, "health", "--target", f"https://{ADDRESS}", "--tls-ca", f"{CERTS}/ca.pem",
         "--tls-cert", f"{CERTS}/client.pem", "--tls-key", f"{CERTS}/client-key.pem"],
        capture_output=True, text=True,
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "SERVING", probe

    # Mutual TLS: no client certificate, no connection.
    try:
        rpc.AccountServiceStub(channel(with_client_cert=False)).GetAccount(
            pb.GetAccountRequest(account_id=payer), metadata=auth(admin), timeout=5)
        raise AssertionError("a client without a certificate was served")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    print("python contract: TLS, mTLS, JWT refusals and reasons, merchant isolation, created_by, replay, "
          "Withdraw, order expiry, holds, message size, health command: all as documented")


if __name__ == "__main__":
    main()
