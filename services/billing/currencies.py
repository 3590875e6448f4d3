"""ISO 4217 currencies a contract may be billed in, with their minor-unit exponents.

The list is ISO 4217 "list one" (SIX, the maintenance agency): every code with a defined
minor unit. Codes without one (precious metals XAU/XAG/XPD/XPT, the bond-market units
XBA-XBD, XDR, XSU, XUA, and the testing/no-currency codes XTS/XXX) cannot carry a fee in
minor units, so they are refused. The exponent turns integer minor units into the decimal
amounts of the FOCUS export (JPY has 0 decimals, KWD 3, CLF 4).
"""

from __future__ import annotations

from decimal import Decimal


def _codes(text: str) -> frozenset[str]:
    return frozenset(text.split())


_ZERO_DECIMALS = _codes("BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX UYI VND VUV XAF XOF XPF")
_THREE_DECIMALS = _codes("BHD IQD JOD KWD LYD OMR TND")
_FOUR_DECIMALS = _codes("CLF UYW")
_TWO_DECIMALS = _codes(
    """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BMD BND BOB BOV BRL BSD BTN
    BWP BYN BZD CAD CDF CHE CHF CHW CNY COP COU CRC CUC CUP CVE CZK DKK DOP DZD EGP ERN
    ETB EUR FJD FKP GBP GEL GHS GIP GMD GTQ GYD HKD HNL HTG HUF IDR ILS INR IRR JMD KES
    KGS KHR KPW KYD KZT LAK LBP LKR LRD LSL MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK
    MXN MXV MYR MZN NAD NGN NIO NOK NPR NZD PAB PEN PGK PHP PKR PLN QAR RON RSD RUB SAR
    SBD SCR SDG SEK SGD SHP SLE SLL SOS SRD SSP STN SVC SYP SZL THB TJS TMT TOP TRY TTD
    TWD TZS UAH USD USN UYU UZS VED VES WST XCD XCG YER ZAR ZMW ZWG ZWL
    """
)

MINOR_UNITS: dict[str, int] = {
    **dict.fromkeys(_TWO_DECIMALS, 2),
    **dict.fromkeys(_ZERO_DECIMALS, 0),
    **dict.fromkeys(_THREE_DECIMALS, 3),
    **dict.fromkeys(_FOUR_DECIMALS, 4),
}


def is_currency(code: str) -> bool:
    """True when ``code`` is an ISO 4217 currency with a minor unit."""
    return code in MINOR_UNITS


def to_decimal(amount_minor: int, currency: str) -> Decimal:
    """Integer minor units as an exact decimal amount with the currency's decimals."""
    exponent = MINOR_UNITS[currency]
    return Decimal(amount_minor).scaleb(-exponent).quantize(Decimal(1).scaleb(-exponent))
