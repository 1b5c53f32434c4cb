/* A trivial bridge between two interfaces over AF_PACKET sockets, one thread per direction: the references that
 * scripts/bench-linkface.sh compares flexstack's link face with, one per design of a link face.
 * usage: packet_forward -m vnet|ring IFACE_A IFACE_B   (forwards until killed)
 *   vnet: recv()/send() of one frame per system call with PACKET_VNET_HDR: GSO super-frames of up to 64 KiB pass
 *         whole with their virtio-net header, checksums left partial (the design of flexstack's `packet` face);
 *   ring: PACKET_MMAP rings, TPACKET_V3 to receive (blocks of frames, one poll() per block) and TPACKET_V2 to send
 *         (frames queued in the ring, one send() per batch). These rings carry no virtio-net header, so every frame
 *         must be a wire-sized one: the script turns GSO, TSO and GRO off on the interfaces for this mode. */
#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define VNET_HDR_LEN 10
#define BUF_LEN (65536 + 64)
#define BLOCK_SIZE (1 << 20)
#define BLOCKS 16
#define FRAME_SIZE 2048
#define TX_FRAMES 1024

/* A packet socket on interface `name`; `rx`: it receives what arrives there (else it only sends: protocol 0, so the
 * kernel does not queue every frame to it too). */
static int packet_socket(const char *name, int vnet, int rx) {
  int proto = rx ? htons(ETH_P_ALL) : 0;
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, proto);
  if (fd < 0) { perror("socket"); exit(1); }
  if (vnet) {
    int one = 1;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0) { perror("PACKET_VNET_HDR"); exit(1); }
  }
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  struct sockaddr_ll sll = { .sll_family = AF_PACKET, .sll_protocol = (unsigned short)proto };
  sll.sll_ifindex = (int)if_nametoindex(name);
  if (!sll.sll_ifindex) { perror(name); exit(1); }
  if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0) { perror("bind"); exit(1); }
  /* Only what arrives on the interface, not what this program sends on it. */
  int ignore = 1;
  setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &ignore, sizeof ignore);
  return fd;
}

struct half { const char *from, *to; int mode_ring; };

static void *forward_vnet(struct half *h) {
  int in = packet_socket(h->from, 1, 1), out = packet_socket(h->to, 1, 0);
  static __thread char buf[BUF_LEN];
  for (;;) {
    ssize_t n = recv(in, buf, sizeof buf, 0);
    if (n < 0) { perror("recv"); return NULL; }
    if (n > VNET_HDR_LEN && send(out, buf, (size_t)n, 0) < 0) { /* dropped */ }
  }
}

static void *forward_ring(struct half *h) {
  int in = packet_socket(h->from, 0, 1), out = packet_socket(h->to, 0, 0);
  int v3 = TPACKET_V3, v2 = TPACKET_V2;
  if (setsockopt(in, SOL_PACKET, PACKET_VERSION, &v3, sizeof v3) < 0) { perror("TPACKET_V3"); exit(1); }
  struct tpacket_req3 rx = { .tp_block_size = BLOCK_SIZE, .tp_block_nr = BLOCKS, .tp_frame_size = FRAME_SIZE,
                             .tp_frame_nr = BLOCK_SIZE / FRAME_SIZE * BLOCKS, .tp_retire_blk_tov = 1 };
  if (setsockopt(in, SOL_PACKET, PACKET_RX_RING, &rx, sizeof rx) < 0) { perror("PACKET_RX_RING"); exit(1); }
  uint8_t *rx_map = mmap(NULL, (size_t)BLOCK_SIZE * BLOCKS, PROT_READ | PROT_WRITE, MAP_SHARED, in, 0);
  if (rx_map == MAP_FAILED) { perror("mmap rx"); exit(1); }
  if (setsockopt(out, SOL_PACKET, PACKET_VERSION, &v2, sizeof v2) < 0) { perror("TPACKET_V2"); exit(1); }
  struct tpacket_req tx = { .tp_block_size = FRAME_SIZE * 64, .tp_block_nr = TX_FRAMES / 64,
                            .tp_frame_size = FRAME_SIZE, .tp_frame_nr = TX_FRAMES };
  if (setsockopt(out, SOL_PACKET, PACKET_TX_RING, &tx, sizeof tx) < 0) { perror("PACKET_TX_RING"); exit(1); }
  uint8_t *tx_map = mmap(NULL, (size_t)FRAME_SIZE * TX_FRAMES, PROT_READ | PROT_WRITE, MAP_SHARED, out, 0);
  if (tx_map == MAP_FAILED) { perror("mmap tx"); exit(1); }
  unsigned block = 0, tx_at = 0;
  struct pollfd pfd = { .fd = in, .events = POLLIN };
  for (;;) {
    struct tpacket_block_desc *b = (void *)(rx_map + (size_t)block * BLOCK_SIZE);
    if (!(b->hdr.bh1.block_status & TP_STATUS_USER)) {
      poll(&pfd, 1, -1);
      continue;
    }
    struct tpacket3_hdr *p = (void *)((uint8_t *)b + b->hdr.bh1.offset_to_first_pkt);
    unsigned queued = 0;
    for (unsigned i = 0; i < b->hdr.bh1.num_pkts; i++) {
      struct tpacket2_hdr *t = (void *)(tx_map + (size_t)tx_at * FRAME_SIZE);
      unsigned len = p->tp_snaplen;
      if (t->tp_status == TP_STATUS_AVAILABLE && len <= FRAME_SIZE - TPACKET2_HDRLEN) {
        memcpy((uint8_t *)t + TPACKET2_HDRLEN - sizeof(struct sockaddr_ll), (uint8_t *)p + p->tp_mac, len);
        t->tp_len = len;
        t->tp_status = TP_STATUS_SEND_REQUEST;
        tx_at = (tx_at + 1) % TX_FRAMES;
        queued++;
      } /* else: the ring is full or the frame too large: dropped */
      p = (void *)((uint8_t *)p + p->tp_next_offset);
    }
    if (queued && send(out, NULL, 0, MSG_DONTWAIT) < 0) { /* what the ring held is sent at the next call */ }
    b->hdr.bh1.block_status = TP_STATUS_KERNEL;
    block = (block + 1) % BLOCKS;
  }
}

static void *forward(void *arg) {
  struct half *h = arg;
  return h->mode_ring ? forward_ring(h) : forward_vnet(h);
}

int main(int argc, char **argv) {
  int ring = -1, opt;
  while ((opt = getopt(argc, argv, "m:")) != -1) {
    if (opt == 'm' && !strcmp(optarg, "vnet")) ring = 0;
    else if (opt == 'm' && !strcmp(optarg, "ring")) ring = 1;
    else ring = -2;
  }
  if (ring < 0 || argc - optind != 2) {
    fprintf(stderr, "usage: %s -m vnet|ring IFACE_A IFACE_B\n", argv[0]);
    return 2;
  }
  struct half ab = { argv[optind], argv[optind + 1], ring }, ba = { argv[optind + 1], argv[optind], ring };
  pthread_t t;
  if (pthread_create(&t, NULL, forward, &ab)) { perror("pthread_create"); return 1; }
  printf("ready\n");
  fflush(stdout);
  forward(&ba);
  return 1;
}
