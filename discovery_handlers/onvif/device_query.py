"""ONVIF device-service queries over HTTP (aiohttp): GetDeviceInformation (is the camera
there, and does it accept our credentials?), GetNetworkInterfaces (IP and MAC address) and,
when needed for a scope filter, GetScopes.

Every call runs under a timeout; a semaphore bounds how many cameras are queried at once.
Credentials go into a fresh WS-Security UsernameToken (PasswordDigest) per call and are never
logged. Redirects are not followed and proxy variables are ignored (cameras are on the local
network).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from discovery_handlers.onvif import soap
from discovery_handlers.onvif.credentials import Credential, CredentialStore

log = logging.getLogger("discovery_handlers.onvif")

DEFAULT_TIMEOUT = 2.0
DEFAULT_CONCURRENCY = 16


class CallFailed(Exception):
    """The camera did not give a usable answer (unreachable, timeout, not SOAP)."""


class Refused(Exception):
    """The camera answered with a SOAP Fault (or HTTP 401)."""

    def __init__(self, fault: soap.Fault) -> None:
        super().__init__(f"{fault.code} {'/'.join(fault.subcodes)} {fault.reason}".strip())
        self.fault = fault


@dataclass(frozen=True)
class QueryResult:
    """What the device service told us about one camera address.

    ``offered`` is False when the camera must not be offered: it did not answer SOAP at all,
    or it rejected the credentials configured for it. Otherwise IP/MAC (and scopes, if asked
    for) are set where the camera reported them."""

    offered: bool
    problem: str = ""
    reason: str = ""  # the Event reason when not offered (CamelCase)
    ip: str | None = None
    mac: str | None = None
    scopes: tuple[str, ...] | None = None
    information: soap.DeviceInformation | None = None


class DeviceQuerier:
    """Queries cameras' device services; use as ``async with``."""

    def __init__(
        self,
        credentials: CredentialStore,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self._semaphore = asyncio.Semaphore(concurrency)
        self._session: Any = None

    async def __aenter__(self) -> DeviceQuerier:
        import aiohttp  # lazily: only when an onvif Configuration runs

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            trust_env=False,
            connector=aiohttp.TCPConnector(force_close=True, resolver=_resolver(self.timeout)),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, url: str, operation: str, credential: Credential | None) -> Any:
        """POST one request; the SOAP Body of a successful answer. Raises :class:`Refused`
        for a Fault and :class:`CallFailed` for anything else."""
        import aiohttp

        token = (
            soap.make_token(credential.username, credential.password)
            if credential is not None
            else None
        )
        try:
            async with self._session.post(
                url,
                data=soap.request(operation, token),
                headers={"Content-Type": soap.action_header(operation)},
                allow_redirects=False,
            ) as response:
                data = await _read_capped(response.content, soap.MAX_RESPONSE_BYTES)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as error:
            raise CallFailed(f"{operation}: {type(error).__name__} {error}".strip()) from None
        if status == 401:
            raise Refused(soap.Fault("Sender", ("NotAuthorized",), "HTTP 401"))
        try:
            body = soap.parse_envelope(data)
        except soap.SoapError as error:
            raise CallFailed(f"{operation}: HTTP {status}, {error}") from None
        fault = soap.find_fault(body)
        if fault is not None:
            raise Refused(fault)
        if status != 200:
            raise CallFailed(f"{operation}: HTTP {status}")
        return body

    async def query(self, url: str, uuid: str, *, want_scopes: bool = False) -> QueryResult:
        """Query the camera ``uuid`` at its device service ``url``."""
        async with self._semaphore:
            return await self._query(url, uuid, want_scopes)

    async def _query(self, url: str, uuid: str, want_scopes: bool) -> QueryResult:
        credential = self.credentials.get(uuid)
        information = None
        try:
            information = soap.parse_device_information(
                await self.call(url, "GetDeviceInformation", credential)
            )
        except CallFailed as error:
            return QueryResult(
                offered=False, problem=f"no answer: {error}", reason="OnvifCameraNotAnswering"
            )
        except soap.SoapError as error:
            return QueryResult(
                offered=False, problem=f"bad answer: {error}", reason="OnvifCameraBadAnswer"
            )
        except Refused as refused:
            if refused.fault.not_authorized and credential is not None:
                return QueryResult(
                    offered=False,
                    problem=f"credentials rejected ({refused.fault.reason})",
                    reason="OnvifCredentialsRejected",
                )
            log.info(
                "onvif: %s (%s) GetDeviceInformation refused: %s%s",
                url,
                uuid,
                refused,
                "; set credentials for it in discoveryProperties"
                if refused.fault.not_authorized
                else "",
            )
        ip = mac = None
        try:
            ip, mac = soap.parse_network_interfaces(
                await self.call(url, "GetNetworkInterfaces", credential)
            )
        except (CallFailed, Refused, soap.SoapError) as error:
            log.info("onvif: %s (%s) IP/MAC unknown: GetNetworkInterfaces %s", url, uuid, error)
        scopes = None
        if want_scopes:
            try:
                scopes = soap.parse_scopes(await self.call(url, "GetScopes", credential))
            except (CallFailed, Refused, soap.SoapError) as error:
                log.info("onvif: %s (%s) scopes unknown: GetScopes %s", url, uuid, error)
        return QueryResult(offered=True, ip=ip, mac=mac, scopes=scopes, information=information)


async def _read_capped(content: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise ValueError(f"answer larger than {limit} bytes")
        chunks.append(chunk)


def _resolver(seconds: float) -> Any:
    """aiohttp's resolver interface over :mod:`discovery_handlers.resolver` (its own threads:
    aiohttp's default resolver uses the loop's default executor, which a DNS server that
    never answers would fill, and the agent shares it). A camera whose XAddr names a host
    that is not a host name, or does not resolve, fails that camera's call only."""
    import socket

    from aiohttp.abc import AbstractResolver, ResolveResult

    from discovery_handlers.resolver import LookupFailed, shared_resolver

    class OwnThreadsResolver(AbstractResolver):
        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ) -> list[ResolveResult]:
            try:
                addresses = await shared_resolver().lookup(host, seconds=seconds, quiet=seconds)
            except LookupFailed as error:
                raise OSError(str(error)) from None
            return [
                ResolveResult(
                    hostname=host, host=address, port=port, family=kind, proto=0,
                    flags=socket.AI_NUMERICHOST,
                )
                for kind, address in addresses
                if family in (socket.AF_UNSPEC, kind)
            ]  # fmt: skip

        async def close(self) -> None:
            return None

    return OwnThreadsResolver()
