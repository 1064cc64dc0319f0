#!/usr/bin/env bash
echo "not yet implemented: see README" >&2
exit 2
