/* Example: an application with one meter and one knob.
 *
 *   make && FLEXSTACK_STATE_DIR=/tmp/fs ./example demo 30
 *   flexstack --state-dir /tmp/fs get app.demo.ticks      # the meter, counting up ten times a second
 *   flexstack --state-dir /tmp/fs set app.demo.level 7    # the knob: prints "level=7"
 *   flexstack --state-dir /tmp/fs set app.demo.level -1   # refused by the callback: the set fails
 *
 * Arguments: the application's name (default "demo") and how many seconds to run (default: until killed).
 * A rule can drive the knob too: `set("app.demo.level", If(Greater(get("app.demo.ticks"), 50), 9, 1))`. */
#define _POSIX_C_SOURCE 200809L
#include "flexstack_app.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long level = 0;

/* The knob's callback: accepts levels 0..100, refuses anything else. */
static int on_level(fs_app *app, const char *name, const char *value, void *user) {
    (void)user;
    char *end;
    long v = strtol(value, &end, 10);
    if (*end || v < 0 || v > 100) {
        fs_app_refuse(app, "level must be within 0..100");
        return -1;
    }
    level = v;
    printf("%s=%ld\n", name, level);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "demo";
    double seconds = argc > 2 ? atof(argv[2]) : -1;
    fs_app *app = fs_app_open(NULL);
    if (!app) {
        perror("fs_app_open");
        return 1;
    }
    if (fs_app_meter(app, "ticks", FS_U64) || fs_app_knob(app, "level", FS_I64, "0", on_level, NULL) ||
        fs_app_register(app, name)) {
        fprintf(stderr, "register: %s\n", fs_app_error(app));
        return 1;
    }
    printf("registered app.%s.ticks and app.%s.level\n", name, name);
    fflush(stdout);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned long long ticks = 1;; ticks++) {
        if (fs_app_update_u64(app, "ticks", ticks) || fs_app_poll(app, 100) < 0) {
            fprintf(stderr, "flexstack: %s\n", fs_app_error(app));
            return 1;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        double elapsed = (double)(now.tv_sec - start.tv_sec) + (double)(now.tv_nsec - start.tv_nsec) / 1e9;
        if (seconds >= 0 && elapsed >= seconds) break;
    }
    fs_app_close(app);
    return 0;
}
