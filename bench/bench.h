// What the C helpers of the benchmark scripts share: dying with the failed call's message, a monotonic clock in
// microseconds, and the order of doubles for qsort (medians and percentiles of round-trip times).
#ifndef FLEXSTACK_BENCH_H
#define FLEXSTACK_BENCH_H
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static void die(const char *what) {
  perror(what);
  exit(1);
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static inline int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
#endif
