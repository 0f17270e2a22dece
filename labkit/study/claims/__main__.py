"""`python -m labkit.study.claims`: the table, its counts by source, and any claim that fails."""
from labkit.study.claims import CLAIMS, check, counts

for claim in CLAIMS:
    print(f"{claim.text:45s} {claim.number}")
print(f"{len(CLAIMS)} claims: " + ", ".join(f"{n} {name}" for name, n in counts().items()))
print(f"failing: {check() or 'none'}")
