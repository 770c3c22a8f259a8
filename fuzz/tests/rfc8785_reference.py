"""RFC 8785 reference for the `fingerprint` corpus: reads JSON lines on stdin, each
{"input": <JSON text>, "canonical": <the filter's canonical text>}, and canonicalises the
same input with the `rfc8785` package (pure Python: its own float formatting, and Python's
own JSON reader). Prints each disagreement; exits 1 if there is one, 2 if nothing was
compared.

Integers beyond +-(2^53 - 1) are read as doubles, as RFC 8785 reads every number (the
package refuses them as integers).
"""

import json
import sys

import rfc8785

SAFE = 2**53 - 1


def read_int(text):
    n = int(text)
    return n if -SAFE <= n <= SAFE else float(text)


def main():
    compared = 0
    failures = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        value = json.loads(case["input"], parse_int=read_int)
        arguments = value if isinstance(value, dict) else {"v": value}
        ours = rfc8785.dumps({"tool": case["tool"], "arguments": arguments}).decode("utf-8")
        compared += 1
        if ours != case["canonical"]:
            failures += 1
            print(f"input:     {case['input']}\nfilter:    {case['canonical']}\nrfc8785:   {ours}\n")
    print(f"rfc8785 reference: {compared} compared, {failures} different")
    if failures:
        sys.exit(1)
    if compared == 0:
        sys.exit(2)


if __name__ == "__main__":
    main()
